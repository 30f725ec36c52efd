-- Repositories are remotes: a URL (or an absolute path, which git treats as a local remote)
-- that workers fetch from and push to, and an access mode (1 write, 2 read: context only).
-- Rows stored before were local paths, writable.
ALTER TABLE session_repos ADD COLUMN url TEXT NOT NULL DEFAULT '';
ALTER TABLE session_repos ADD COLUMN access INTEGER NOT NULL DEFAULT 1;
UPDATE session_repos SET url = path;
