-- The one index of every session's tasks by state (`tasks_claim`) serves only reads of ready
-- tasks across sessions: the capability-gap scan, and the quota rebuild with `tasks_lease` for
-- the running ones (claims read one session's through `tasks_session_state`). Holding every
-- task, it moved with each state change of each task (a delete and an insert: every task's
-- claim, completion and readying); holding only the ready ones, a task enters it when it
-- becomes ready and leaves it when claimed. The queries name the state as a constant, which
-- the partial index's condition needs.
DROP INDEX tasks_claim;
CREATE INDEX tasks_ready ON tasks (role, priority, path_ms DESC, created_at, session_id, position)
  WHERE state = 2;
