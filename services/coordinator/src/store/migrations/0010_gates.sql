-- Approval gates: the tasks a plan asks a person to approve before they run, and the answer.
-- decision: 0 waiting, 1 approved, 2 rejected.
CREATE TABLE gates (
    session_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    prompt TEXT NOT NULL,
    decision INTEGER NOT NULL DEFAULT 0,
    decided_by TEXT NOT NULL DEFAULT '',
    note TEXT NOT NULL DEFAULT '',
    decided_at BIGINT,
    PRIMARY KEY (session_id, task_id)
);
