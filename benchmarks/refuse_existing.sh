# Sourced by the setup scripts (benchmarks/*.sh) that build a directory beside its final path (DIR.partial) and
# rename it at the end: refuse_existing DIR exits 2, with one line, if DIR or DIR.partial is already there, so a
# user's directory (or a half-built one to look at) is never touched.
refuse_existing() {
  if [ -e "$1" ] || [ -e "$1.partial" ]; then
    echo "error: $1 or $1.partial already exists; remove it or pass another directory" >&2
    exit 2
  fi
}
