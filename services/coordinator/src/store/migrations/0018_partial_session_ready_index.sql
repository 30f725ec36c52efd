-- A session's ready tasks in claim order (claims in one session, and the pick of the session
-- to claim from), as `tasks_session_state` gave them, holding only the ready tasks. Indexed on
-- `state`, every state change of every task moved its entry (a delete and an insert: every
-- task's readying, claim and completion); now a task enters this index when it becomes ready
-- and leaves it when claimed. Reads of a session's tasks by any state go through
-- `tasks_state_position`. The queries name the ready state as a constant, which the partial
-- index's condition needs.
DROP INDEX tasks_session_state;
CREATE INDEX tasks_session_ready ON tasks (session_id, role, priority, path_ms DESC, created_at, position)
  WHERE state = 2;
