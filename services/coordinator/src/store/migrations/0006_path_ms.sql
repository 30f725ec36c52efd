-- Claims rank ready tasks by their estimated remaining critical path in milliseconds (the sum
-- of the plan's `estimate_seconds` along the longest chain of dependents) instead of its length
-- in tasks. Rows stored before this weigh every task 60 s, the default of a plan without
-- estimates, so their order is unchanged.
ALTER TABLE tasks ADD COLUMN path_ms BIGINT NOT NULL DEFAULT 0;
UPDATE tasks SET path_ms = critical_path * 60000;
DROP INDEX tasks_claim;
DROP INDEX tasks_session_state;
CREATE INDEX tasks_claim ON tasks (state, role, priority, path_ms DESC, created_at, session_id, position);
CREATE INDEX tasks_session_state ON tasks (session_id, state, role, priority, path_ms DESC, created_at, position);
