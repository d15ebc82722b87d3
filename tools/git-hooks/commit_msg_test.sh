#!/usr/bin/env bash
# The commit-msg hook on sample messages (CTest commit_msg_hook): a good one
# passes, a 73-character subject, a missing body or a body without its blank
# line are refused with a message saying so; merges and fixups pass.
set -u
hook=$1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=0

check() {  # check WANT_STATUS REGEX MESSAGE: the hook's status, and REGEX in its output
  local want=$1 regex=$2 out rc
  printf '%s' "$3" >"$scratch/msg"
  out=$(bash "$hook" "$scratch/msg" 2>&1)
  rc=$?
  if [ "$rc" -ne "$want" ] || ! grep -qE -- "$regex" <<<"$out"; then
    echo "FAIL: status $rc (expected $want), output /$regex/ expected, for the message:"
    cat "$scratch/msg"
    echo "--- hook said:"
    echo "$out"
    failed=1
  fi
}

s72=$(printf 'x%.0s' $(seq 72))
s73=$(printf 'x%.0s' $(seq 73))
why=$'\n\nThe reason for the change, in a sentence.\n'

check 0 '^$' "Fix the pool count after a trim${why}"
check 0 '^$' "${s72}${why}"
# 72 characters of UTF-8 (the em dash is one character, three bytes).
check 0 '^$' "$(printf 'y%.0s' $(seq 70)) —${why}"
check 0 '^$' $'Fix a thing\n\nWhy.\n# Please enter the commit message for your changes.\n'
check 0 '^$' $'\n\nFix a thing\n\nWhy.\n'
check 1 'subject is 73 characters, over 72' "${s73}${why}"
check 1 'no body' $'Fix the pool count after a trim\n'
check 1 'no body' $'Fix the pool count after a trim\n\n\n# only a comment\n'
check 1 'no body' $'Fix the pool count after a trim\n\n# ------------------------ >8 ------------------------\nthe diff\n'
check 1 'second line is not blank' $'Fix the pool count\nafter a trim, because\n'
check 1 'message is empty' $'# nothing\n'
check 0 '^$' $'Merge branch \'harness\' into main\n'
check 0 '^$' "fixup! ${s73}"
check 0 '^$' "squash! Fix a thing"
exit "$failed"
