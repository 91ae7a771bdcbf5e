#!/usr/bin/env python3
"""Cluster suite: the deploy files (deploy/systemd/, deploy/k8s/) checked offline.

- every systemd unit passes `systemd-analyze verify` (its ExecStart pointed at
  this build's binaries, which must exist);
- the Kubernetes manifests validate against the API schema (kubernetes-validate
  --strict: no unknown fields);
- the config files the ConfigMap carries load through tandem's own parsers
  (`tandem-router --config` with a bad path would refuse them; here the ops
  file through `tandem scale`'s reader and the config through a worker's
  --help-free dry parse).
Run with pytest (tests/conftest.py says how)."""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from harness import BIN, ROOT, check


def test_systemd_units():
    units = sorted(glob.glob(os.path.join(ROOT, "deploy/systemd/*.service")))
    d = tempfile.mkdtemp(prefix="tandem-units-")
    try:
        for u in units:
            with open(u) as f, open(os.path.join(d, os.path.basename(u)), "w") as g:
                g.write(f.read().replace("/usr/local/bin/", BIN + "/"))
        r = subprocess.run(["systemd-analyze", "verify"] + ["./" + os.path.basename(u) for u in units], cwd=d,
                           capture_output=True, text=True, timeout=60)
        check("%d systemd units pass systemd-analyze verify (%s)" %
              (len(units), ", ".join(os.path.basename(u) for u in units)),
              len(units) >= 5 and r.returncode == 0 and not r.stderr.strip(), r.stderr[-1500:])
    finally:
        shutil.rmtree(d)


def test_kubernetes_manifests():
    manifests = sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/*.yaml")))
    kv = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    r = subprocess.run([kv, "--strict", "--quiet"] + manifests, capture_output=True, text=True, timeout=120)
    kinds = []
    for m in manifests:
        kinds += [l.split(":", 1)[1].strip() for l in open(m) if l.startswith("kind:")]
    check("the Kubernetes manifests validate (kubernetes-validate --strict): %s" % ", ".join(kinds),
          r.returncode == 0 and {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= set(kinds),
          (r.stdout + r.stderr)[-1500:])
    # the image is the one deploy/container/build.sh builds, and the programs it starts are the package's
    tag = re.search(r'tag=\$\{1:-([^}]+)\}', open(os.path.join(ROOT, "deploy/container/build.sh")).read()).group(1)
    text = "".join(open(m).read() for m in manifests)
    images = set(re.findall(r"image: (\S+)", text)) - {i for i in re.findall(r"image: (\S+)", text) if "etcd" in i}
    progs = set(re.findall(r"command: \[(/usr/bin/[\w-]+)", text))
    check("the manifests run the image deploy/container/build.sh makes (%s) and programs it installs (%s)" %
          (", ".join(sorted(images)), ", ".join(sorted(progs))),
          images == {"localhost/" + tag} and len(progs) == 4 and
          all(os.path.exists(os.path.join(BIN, os.path.basename(p))) for p in progs), text[:0])
    # a malformed manifest is refused: the check can fail
    bad = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    bad.write("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n")
    bad.close()
    r = subprocess.run([kv, "--strict", "--quiet", bad.name], capture_output=True, text=True, timeout=60)
    os.unlink(bad.name)
    check("a malformed manifest is refused by the same check", r.returncode != 0, r.stdout)


def test_configmap_files():
    """The files the ConfigMap carries load through tandem's own readers."""
    manifests = sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/*.yaml")))
    # the files the ConfigMap carries load through tandem's own readers
    import yaml  # noqa: E402 (PyYAML comes with kubernetes-validate)
    for m in manifests:
        for doc in yaml.safe_load_all(open(m)):
            if not doc or doc.get("kind") != "ConfigMap":
                continue
            tmp = tempfile.mkdtemp(prefix="tandem-cm-")
            for name, text in doc["data"].items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            if "ops.yaml" in doc["data"]:
                # tandem scale reads and checks the file before it calls anyone: a refused file exits 2
                r = subprocess.run([BIN + "/tandem", "scale", "--endpoint", "127.0.0.1:1", "--apply",
                                    os.path.join(tmp, "ops.yaml")], capture_output=True, text=True, timeout=30)
                check("the ConfigMap's ops.yaml is a valid ops config", r.returncode != 2, r.stderr)
            if "tandem.yaml" in doc["data"]:
                # tandem up reads and validates the config before it starts anything; the model is absent
                r = subprocess.run([BIN + "/tandem", "up", "--config", os.path.join(tmp, "tandem.yaml")],
                                   capture_output=True, text=True, timeout=30)
                check("the ConfigMap's tandem.yaml is a valid config file (it reaches the model check)",
                      "cannot read the model /models/" in r.stderr, r.stderr)
            shutil.rmtree(tmp)

