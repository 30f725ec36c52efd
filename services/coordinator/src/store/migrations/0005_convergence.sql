-- Write-back of a validator task's per-criterion results onto the tasks it checked (an encoded
-- troupe.v1.TaskConvergence); NULL until a validator has checked the task.
ALTER TABLE tasks ADD COLUMN convergence BLOB;
