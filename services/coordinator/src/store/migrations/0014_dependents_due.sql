-- A completion finds the tasks waiting on it through `task_deps_dependents`; holding `task_id`
-- too makes the index covering, without which SQLite's planner (no statistics) prefers the
-- covering primary key and walks every dependency row of the session (10 ms a batch at
-- 50,000 tasks).
DROP INDEX task_deps_dependents;
CREATE INDEX task_deps_dependents ON task_deps (session_id, dep_id, task_id);
-- The reaper's due retries (pending tasks with a `not_before` passed), a range of this index
-- instead of a walk over every pending task, four times a second.
CREATE INDEX tasks_due ON tasks (state, not_before);
-- Claims pick the active session served least recently (`updated_at` moves with every event
-- of the session), walking this index.
CREATE INDEX sessions_served ON sessions (state, updated_at);
