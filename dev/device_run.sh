#!/usr/bin/env bash
# A device call's command with every log it writes packed into one tarball, also when it runs out of
# time: the device machine returns at most 8 files of $OUT, and nothing of what a command killed at
# the call's limit had not yet copied there (session 31 lost a profile and two A/B rounds that way).
#
#   bash dev/device_run.sh 'bash .kit/setup.sh >/tmp/setup.log 2>&1; bash dev/ab_bench.sh run ...'
#
# Put TE's setup inside the command, as above: its minute then counts against DEVICE_RUN_S (session
# 49: setup before device_run plus a 575 s limit passed the call's 600 s, and the tarball was lost).
#
# The command runs with OUT=/tmp/device_out (te_env.sh's $out: the scripts' logs go there) under
# `timeout` at DEVICE_RUN_S seconds (default 570: under the call's 600 s), then everything under
# /tmp/device_out goes into $OUT/device_out.tgz (paths as under docs/results: bench/..., tests/...).
# Exit status: the command's (124: it ran out of time; what it wrote is in the tarball all the same).
set -u
dest=${OUT:?"OUT: the device call's output folder"}
limit=${DEVICE_RUN_S:-570}
scratch=${DEVICE_RUN_DIR:-/tmp/device_out}
# emptied first: a warm machine keeps /tmp between calls, and the last call's logs went back with it
rm -rf "$scratch" && mkdir -p "$scratch"
OUT=$scratch timeout --kill-after=5 "$limit" bash -c "$1"
rc=$?
[ $rc = 124 ] && echo "device_run: stopped at ${limit} s (DEVICE_RUN_S); packing what was written"
tar -czf "$dest/device_out.tgz" -C "$scratch" . && echo "device_run: $(find "$scratch" -type f | wc -l) files in $dest/device_out.tgz"
exit $rc
