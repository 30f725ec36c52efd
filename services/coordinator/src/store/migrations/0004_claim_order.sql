-- Claims walk an index in claim order instead of sorting every ready task: priority, longest
-- remaining critical path, older first, then plan order. The second index serves per-session
-- reads by state (a session's claimable tasks, "is anything ready or running", dependents).
CREATE INDEX tasks_claim ON tasks (state, role, priority, critical_path DESC, created_at, session_id, position);
CREATE INDEX tasks_session_state ON tasks (session_id, state, role, priority, critical_path DESC, created_at, position);
DROP INDEX tasks_state;
