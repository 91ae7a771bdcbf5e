# podman-opts.sh — sourced by build.sh and tests/package/test_image.sh: the
# podman options this machine needs, in the array podman_opts. runc where it is
# installed (crun refuses hosts whose cgroups are v1 and v2 at once); the limits
# podman would raise kept at this shell's (a sandboxed host may not raise them;
# some refuse even setting the process limit to its own hard value: at most
# 32768); the host's network (RUN steps reach the Debian mirror).
nproc_limit=$(ulimit -Hu)
{ [ "$nproc_limit" = unlimited ] || [ "$nproc_limit" -gt 32768 ]; } && nproc_limit=32768
podman_opts=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=$nproc_limit:$nproc_limit" --network host)
podman_global=()
command -v runc >/dev/null && podman_global=(--runtime runc)
