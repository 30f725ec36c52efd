-- Files a plan brings along (agent scripts, an EXEC phase's task files), stored once per
-- content (SHA-256 digest) as the base64 of their protobuf bundle, and the bundle each session
-- names ('' for none). Workers fetch a bundle by digest with GetPlanAssets.
CREATE TABLE plan_assets (
    digest TEXT PRIMARY KEY,
    bundle TEXT NOT NULL,
    size BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
ALTER TABLE sessions ADD COLUMN assets_digest TEXT NOT NULL DEFAULT '';
