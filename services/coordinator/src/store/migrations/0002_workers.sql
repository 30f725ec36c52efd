-- Workers seen claiming, with the roles they serve (JSON array of proto role numbers; empty =
-- every role), for capability-gap detection. Written at most every few seconds per worker.
CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    roles TEXT NOT NULL,
    last_seen BIGINT NOT NULL
);
CREATE INDEX workers_seen ON workers (last_seen);
