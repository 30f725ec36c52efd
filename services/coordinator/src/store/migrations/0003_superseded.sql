-- Fix rounds (generator-critic, gap closure): the re-run that replaced a failed task. The task
-- stays failed; a non-empty value means it no longer holds its session back.
ALTER TABLE tasks ADD COLUMN superseded_by TEXT NOT NULL DEFAULT '';
