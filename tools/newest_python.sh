#!/usr/bin/env bash
# Prints the newest Python 3.12+ interpreter on this machine (for
# `make test-newest`), or nothing. pyenv's shims answer for every version
# but run only the selected ones, so its installed versions are looked at
# directly too.
for candidate in python3.14 python3.13 python3.12 \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 \
      2>/dev/null | sort -rV); do
  if "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' \
      >/dev/null 2>&1; then
    command -v "$candidate"
    exit 0
  fi
done
