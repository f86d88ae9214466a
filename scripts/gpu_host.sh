# Sourced by scripts/gpu_check.sh and scripts/gpu_speed.sh on the GPU host (nothing is
# pip-installed there). Writes the package's entry points (pyproject.toml, through which vLLM
# finds the plugin) into a generated rocketkv_vllm dist-info in a temporary folder $EP, removed
# on exit (the caller puts $EP on PYTHONPATH beside a checkout), and defines `step`. Needs $PY
# and $OUT (with its summary.txt).
EP=$(mktemp -d /tmp/rocketkv-entry-points.XXXXXX) || exit 2
trap 'rm -rf "$EP"' EXIT
"$PY" - "$EP" << 'EOF' || { echo "cannot write the entry points"; exit 2; }
import importlib.metadata as md, os, sys, tomllib
proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
name, version = proj["name"], proj["version"]
d = os.path.join(sys.argv[1], f"{name.replace('-', '_')}-{version}.dist-info")
os.makedirs(d)
with open(os.path.join(d, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
with open(os.path.join(d, "entry_points.txt"), "w") as f:
    for group, eps in proj["entry-points"].items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
seen = {(e.group, e.name, e.value) for e in md.Distribution.at(d).entry_points}
want = {(g, k, v) for g, eps in proj["entry-points"].items() for k, v in eps.items()}
assert seen == want, (seen, want)
print(f"entry points of {name} {version}: {sorted(seen)}")
EOF

FAILED=0
step() { # step NAME LIMIT_S COMMAND...: log to $OUT/NAME.log, a line to summary.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if [ "$limit" = 0 ]; then
    printf '%-14s skipped\n' "$name" | tee -a "$OUT/summary.txt"
    return 0
  fi
  echo "\$ $(printf '%q ' "$@")  (limit ${limit}s)" > "$OUT/$name.log"
  timeout -k 15 "$limit" "$@" >> "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-14s exit %-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  if [ "$rc" != 0 ]; then
    FAILED=1
    tail -n 30 "$OUT/$name.log" | sed "s/^/  $name| /"
  fi
  return "$rc"
}
