#!/usr/bin/env bash
# The troupe RPCs, called with grpcurl in the order of docs/grpcurl.md (which also shows
# GetPlanAssets), with checks of their answers.
#
#   troupe-coordinator --listen 127.0.0.1:7071 --data-dir /tmp/tour-coord &   # part 1: the worker protocol by hand
#   troupe up --listen 127.0.0.1:7070 --data-dir /tmp/tour-up &               # part 2: the services
#   examples/grpcurl/tour.sh
#
# COORD and UP override the two addresses. The script stops at the first unexpected answer.
set -euo pipefail
COORD=${COORD:-127.0.0.1:7071}
UP=${UP:-127.0.0.1:7070}
HERE=$(cd "$(dirname "$0")" && pwd)
QUICKSTART=$(cd "$HERE/../quickstart" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Reads one field of the JSON on stdin: `field session.id`.
field() { python3 -c 'import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1].split("."): v=v[int(k)] if k.isdigit() else v[k]
print(v)' "$1"; }
show() { printf '\n$ %s\n' "$*" >&2; }

# --- discovery and health -------------------------------------------------------------------
show grpcurl -plaintext "$UP" list
grpcurl -plaintext "$UP" list
grpcurl -plaintext "$UP" describe troupe.v1.Coordinator.ClaimTasks
grpcurl -plaintext -d '{"service": "troupe.v1.Executor"}' "$UP" grpc.health.v1.Health/Check

# --- part 1: a session driven by hand against a coordinator with no workers -----------------
# CreateSession takes the plan document as a JSON string.
python3 -c 'import json,sys; print(json.dumps({"planJson": open(sys.argv[1]).read(), "baseDir": sys.argv[2]}))' \
  "$QUICKSTART/plan.json" "$QUICKSTART" > "$WORK/create.json"
# dryRun validates and stores nothing.
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["dryRun"]=True; print(json.dumps(r))' \
  "$WORK/create.json" > "$WORK/dry.json"
show grpcurl -plaintext -d @ "$COORD" troupe.v1.Coordinator/CreateSession '< dry.json'
grpcurl -plaintext -d @ "$COORD" troupe.v1.Coordinator/CreateSession < "$WORK/dry.json" > /dev/null

show grpcurl -plaintext -d @ "$COORD" troupe.v1.Coordinator/CreateSession '< create.json'
SESSION=$(grpcurl -plaintext -d @ "$COORD" troupe.v1.Coordinator/CreateSession < "$WORK/create.json" | field session.id)
echo "session $SESSION"

grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\"}" "$COORD" troupe.v1.Coordinator/GetSession > /dev/null
grpcurl -plaintext -d '{"state": "SESSION_STATE_ACTIVE", "limit": 10}' "$COORD" troupe.v1.Coordinator/ListSessions

# Be a worker: claim the executor task that is ready (IMPL-001), under a 60 s lease.
CLAIM=$(grpcurl -plaintext -d '{"workerId": "tour", "roles": ["ROLE_EXECUTOR"], "maxTasks": 1, "wait": "5s", "leaseDuration": "60s"}' \
  "$COORD" troupe.v1.Coordinator/ClaimTasks)
TASK=$(echo "$CLAIM" | field tasks.0.task.id)
TOKEN=$(echo "$CLAIM" | field tasks.0.lease.fencingToken)
echo "claimed $TASK with fencing token $TOKEN"

grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"taskId\": \"$TASK\", \"fencingToken\": \"$TOKEN\", \"progress\": \"editing stats/core.py\"}" \
  "$COORD" troupe.v1.Coordinator/Heartbeat

# A stale fencing token is refused with FAILED_PRECONDITION.
if grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"taskId\": \"$TASK\", \"fencingToken\": \"999\"}" \
  "$COORD" troupe.v1.Coordinator/Heartbeat 2> "$WORK/stale.txt"; then
  echo "a stale token was accepted" >&2; exit 1
fi
grep -q FailedPrecondition "$WORK/stale.txt"

# Fail the attempt (retryable: the coordinator schedules another), then claim and complete it.
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"taskId\": \"$TASK\", \"fencingToken\": \"$TOKEN\", \"error\": {\"kind\": \"ERROR_KIND_RATE_LIMITED\", \"message\": \"backend asked us to slow down\", \"retryable\": true}}" \
  "$COORD" troupe.v1.Coordinator/FailTask
CLAIM=$(grpcurl -plaintext -d '{"workerId": "tour", "roles": ["ROLE_EXECUTOR"], "maxTasks": 1, "wait": "10s"}' \
  "$COORD" troupe.v1.Coordinator/ClaimTasks)
TOKEN=$(echo "$CLAIM" | field tasks.0.lease.fencingToken)
# Complete it, and in the same transaction claim this worker's next task of the session
# (`claimNext`): IMPL-002, which the completion made ready.
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"taskId\": \"$TASK\", \"fencingToken\": \"$TOKEN\", \"result\": {\"summary\": \"median() added by hand\", \"filesModified\": [\"stats/core.py\"]}, \"claimNext\": {\"workerId\": \"tour\", \"roles\": [\"ROLE_EXECUTOR\"], \"maxTasks\": 1, \"leaseDuration\": \"60s\"}}" \
  "$COORD" troupe.v1.Coordinator/CompleteTask > "$WORK/complete.json"
cat "$WORK/complete.json"
[ "$(field next.0.task.id < "$WORK/complete.json")" = IMPL-002 ]

# The message bus.
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"from\": \"executor\", \"type\": \"impl_complete\", \"data\": {\"task_id\": \"$TASK\"}}" \
  "$COORD" troupe.v1.Coordinator/LogMessage
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"type\": \"impl_complete\", \"last\": 10}" "$COORD" troupe.v1.Coordinator/ListMessages
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"role\": \"executor\", \"data\": {\"status\": \"task_complete\", \"task_id\": \"$TASK\"}}" \
  "$COORD" troupe.v1.Coordinator/UpdateState
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"role\": \"executor\"}" "$COORD" troupe.v1.Coordinator/GetState

# Session commands: pause (running tasks finish, nothing new is claimed), a read-only status
# graph, then reconcile-and-advance, which makes the session active again.
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"reason\": \"waiting for review\"}" "$COORD" troupe.v1.Coordinator/PauseSession > "$WORK/pause.json"
grep -q SESSION_STATE_PAUSED "$WORK/pause.json"
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\"}" "$COORD" troupe.v1.Coordinator/CheckSession > "$WORK/check.json"
grep -q IMPL-002 "$WORK/check.json"
grep -q SESSION_STATE_PAUSED "$WORK/check.json"
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\"}" "$COORD" troupe.v1.Coordinator/ResumeSession > "$WORK/resume.json"
grep -q SESSION_STATE_ACTIVE "$WORK/resume.json"

# Cancel the rest; the watch then replays every event and ends.
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"reason\": \"tour over\"}" "$COORD" troupe.v1.Coordinator/CancelSession
grpcurl -plaintext -d "{\"sessionId\": \"$SESSION\", \"afterSequence\": \"0\"}" "$COORD" troupe.v1.Coordinator/WatchSession > "$WORK/events.json"
grep -q SESSION_STATE_CANCELLED "$WORK/events.json"

# --- part 2: the worker services' own RPCs, against `troupe up` -----------------------------
# A git repository to work on: the quickstart's sample repo.
cp -r "$QUICKSTART/repo" "$WORK/repo"
git -C "$WORK/repo" init -q -b main
git -C "$WORK/repo" add -A
git -C "$WORK/repo" -c user.name=tour -c user.email=tour@localhost commit -q -m "sample repo"

grpcurl -plaintext -d '{}' "$UP" troupe.v1.Executor/ListBackends

# ExecuteTask runs one task outside any session and commits the result on a new branch.
python3 - "$WORK/repo" "$QUICKSTART" > "$WORK/execute.json" <<'PY'
import json, sys
repo, plan_dir = sys.argv[1], sys.argv[2]
print(json.dumps({"repoPath": repo, "baseRef": "main", "branch": "tour/median", "baseDir": plan_dir,
  "task": {"id": "IMPL-001", "title": "Add median()", "files": [{"path": "stats/core.py", "action": "modify"}],
           "focus_paths": ["stats", "tests"],
           "agent": {"backend": "command", "command": ["python3", "{plan_dir}/agents/add_median.py", "{worktree}"]}}}))
PY
grpcurl -plaintext -d @ "$UP" troupe.v1.Executor/ExecuteTask < "$WORK/execute.json"

grpcurl -plaintext -d "{\"repoPath\": \"$WORK/repo\", \"ref\": \"tour/median\", \"baseRef\": \"main\", \"files\": [{\"path\": \"stats/core.py\", \"action\": \"FILE_ACTION_MODIFY\"}, {\"path\": \"tests/test_median.py\", \"action\": \"FILE_ACTION_CREATE\"}], \"verification\": [\"python3\", \"-m\", \"compileall\", \"-q\", \"stats\"], \"criteria\": [\"median handles even lengths\"]}" \
  "$UP" troupe.v1.Validator/Validate

grpcurl -plaintext -max-time 300 -d "{\"repoPath\": \"$WORK/repo\", \"ref\": \"tour/median\", \"framework\": \"TEST_FRAMEWORK_PYTEST\", \"install\": true, \"coverageTarget\": 80, \"coverageSource\": \"stats\"}" \
  "$UP" troupe.v1.TestRunner/RunTests

echo "tour complete" >&2
