# Sourced by scripts/gpu_check.sh and scripts/gpu_speed.sh on the GPU host (nothing is
# pip-installed there): writes the package's entry points (pyproject.toml, through which vLLM
# finds the plugin) into a generated rocketkv_vllm dist-info in a temporary folder $EP, removed
# on exit; the caller puts $EP on PYTHONPATH beside a checkout. Needs $PY.
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
