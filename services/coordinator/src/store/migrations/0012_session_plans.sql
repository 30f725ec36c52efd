-- A session's plan as it came in moves to a table of its own. In `sessions` it sat before
-- `last_seq`, which every batch reads and writes: SQLite keeps a row's columns in one record,
-- so each batch of a 50,000-task session walked (and each update rewrote) megabytes of plan
-- spilled over overflow pages, and a batch cost grew with the plan's size.
CREATE TABLE session_plans (
    session_id TEXT PRIMARY KEY REFERENCES sessions (id) ON DELETE CASCADE,
    plan_json TEXT NOT NULL
);
INSERT INTO session_plans (session_id, plan_json) SELECT id, plan_json FROM sessions;
ALTER TABLE sessions DROP COLUMN plan_json;
