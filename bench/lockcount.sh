#!/usr/bin/env bash
# Runs PROGRAM under bench/lockcount.c (LD_PRELOAD) and names each call
# site of its report with addr2line (function, file:line). The program's
# own output is printed first, then the sites: calls, contended calls
# (mutex locks that found the lock held), their wait in ms, kind, where.
#
#   bash bench/lockcount.sh LIBLOCKCOUNT PROGRAM [ARGS...]
set -uo pipefail
lib=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
log=$(mktemp)
LD_PRELOAD=$lib "$@" 2> "$log"
rc=$?
grep -v '^lockcount:' "$log" >&2
while IFS= read -r line; do
  if [[ $line =~ ^lockcount:\ +([0-9]+)\ +([0-9]+)\ +([0-9.]+)\ +([a-z_]+)\ +[^\ ]+\ +(.+)\+0x([0-9a-f]+)$ ]]; then
    module=${BASH_REMATCH[5]}
    off=$(printf '0x%x' $((16#${BASH_REMATCH[6]} - 1))) # the call, not the return address
    where=$(addr2line -f -s -e "$module" "$off" 2> /dev/null | paste -sd' ')
    printf '%12s %10s %10s  %-8s %s\n' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}" "${BASH_REMATCH[4]}" \
      "${where:-$module+$off}"
  else
    echo "$line"
  fi
done < <(grep '^lockcount:' "$log")
rm -f "$log"
exit $rc
