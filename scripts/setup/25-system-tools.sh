#!/usr/bin/env bash
# Sourced by scripts/test. The end-to-end tests that cut a worker off from the coordinator
# need `ip` (iproute2: network namespaces and veth pairs), and the distributed ones make Unix
# users (`useradd`, `groupadd`: passwd). The grpcurl walkthrough (docs/grpcurl.md), which a test
# runs as written, reads answers with `jq`. `troupe graph`'s DOT is
# parsed back by graphviz's `dot`, and `troupe watch` is tested on a real terminal under `tmux`; the
# coordinator's web view in headless `chromium`. All come with Debian; install them when missing and
# this runs as root (CI does), else say what the tests will miss.
system_tools_setup() {
  local missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v useradd >/dev/null 2>&1 || missing+=(passwd)
  command -v jq >/dev/null 2>&1 || missing+=(jq)
  command -v dot >/dev/null 2>&1 || missing+=(graphviz)
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  else
    echo "system tools: ${missing[*]} missing and not root: the partition and distributed tests will be skipped, and the grpcurl walkthrough test fails without jq, the graph, terminal and web view tests without graphviz, tmux and chromium" >&2
  fi
}
system_tools_setup
