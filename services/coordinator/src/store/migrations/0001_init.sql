-- Sessions, their repositories and tasks, the event log, the message bus and role state.
-- Portable SQL (SQLite and PostgreSQL): BIGINT timestamps in unix milliseconds, states as the
-- proto enum numbers, JSON as TEXT, protobuf messages as BLOB (BYTEA on PostgreSQL).
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    description TEXT NOT NULL,
    state INTEGER NOT NULL,
    mode TEXT NOT NULL,
    on_failure TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    plan_dir TEXT NOT NULL,
    last_seq BIGINT NOT NULL DEFAULT 0,
    msg_counter BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX sessions_created ON sessions (created_at);

CREATE TABLE session_repos (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    position INTEGER NOT NULL,
    path TEXT NOT NULL,
    base_commit TEXT NOT NULL,
    branch TEXT NOT NULL,
    PRIMARY KEY (session_id, name)
);

CREATE TABLE tasks (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    id TEXT NOT NULL,
    position INTEGER NOT NULL,
    title TEXT NOT NULL,
    description TEXT NOT NULL,
    role INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    repo TEXT NOT NULL,
    wave INTEGER NOT NULL,
    critical_path INTEGER NOT NULL,
    depends_on TEXT NOT NULL,
    files TEXT NOT NULL,
    spec TEXT NOT NULL,
    state INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    fencing_token BIGINT NOT NULL DEFAULT 0,
    worker_id TEXT NOT NULL DEFAULT '',
    lease_ms BIGINT NOT NULL DEFAULT 0,
    lease_expires_at BIGINT,
    not_before BIGINT,
    created_at BIGINT NOT NULL,
    started_at BIGINT,
    finished_at BIGINT,
    progress TEXT NOT NULL DEFAULT '',
    result BLOB,
    last_error BLOB,
    PRIMARY KEY (session_id, id)
);
CREATE INDEX tasks_state ON tasks (state, priority, critical_path);
CREATE INDEX tasks_lease ON tasks (state, lease_expires_at);

CREATE TABLE events (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    ts BIGINT NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)
);

CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    msg_id TEXT NOT NULL,
    ts BIGINT NOT NULL,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    msg_type TEXT NOT NULL,
    summary TEXT NOT NULL,
    data TEXT,
    idempotency_key TEXT,
    PRIMARY KEY (session_id, seq),
    UNIQUE (session_id, msg_id),
    UNIQUE (session_id, idempotency_key)
);

CREATE TABLE role_state (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    state TEXT NOT NULL,
    PRIMARY KEY (session_id, role)
);
