-- The reaper's two indexes hold only the tasks it looks for: running tasks by lease expiry,
-- pending tasks with a retry time. Indexed on `state`, every write of a task moved its entry in
-- both (a delete and an insert each, the write's largest cost after the row itself); now a
-- task enters `tasks_lease` when it starts running and leaves it when it stops, and
-- `tasks_due` only while it waits for a retry. Their queries name the states as constants;
-- `state` leads each index all the same, so SQLite's planner (no statistics) prefers them to
-- the claim index, which also starts with `state`.
DROP INDEX tasks_lease;
CREATE INDEX tasks_lease ON tasks (state, lease_expires_at) WHERE state = 3;
DROP INDEX tasks_due;
CREATE INDEX tasks_due ON tasks (state, not_before) WHERE state = 1 AND not_before IS NOT NULL;
