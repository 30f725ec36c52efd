-- Each task's dependencies as rows, so a completion finds the tasks that wait on it, and a
-- claim the results upstream of it, through an index instead of reading the session's tasks
-- (`tasks.depends_on` keeps the list, in plan order). Rows stored before this are copied in by
-- the migration's second step (see `migrations.rs`), which the two databases spell apart.
-- No foreign key: tasks are never deleted, and intake then writes the rows without a lookup each.
CREATE TABLE task_deps (
    session_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    dep_id TEXT NOT NULL,
    PRIMARY KEY (session_id, task_id, dep_id)
);
CREATE INDEX task_deps_dependents ON task_deps (session_id, dep_id);
-- Listings page through a session's tasks in plan order (`ListTasks`, `GetSession`).
CREATE INDEX tasks_position ON tasks (session_id, position);
