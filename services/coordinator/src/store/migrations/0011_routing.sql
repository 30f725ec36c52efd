-- Routing by capability. tasks.backends: the backends a worker must offer (one of) to take
-- the task, as `|claude|codex|` (primary first), NULL for any worker; decided at intake.
-- workers.backends: the same form for what a worker offered in its last claim, NULL when it
-- declared none (it may run anything).
ALTER TABLE tasks ADD COLUMN backends TEXT;
ALTER TABLE workers ADD COLUMN backends TEXT;
