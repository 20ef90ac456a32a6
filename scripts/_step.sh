# Sourced by the setup scripts. step "what (about how long)" command...: prints one line for the
# step and how long it took; the command's output is kept in a log and shown only if it fails
# (then the script exits with the command's status).
step() {
    local what="$1" log rc t0=$SECONDS
    shift
    log="$(mktemp "${TMPDIR:-/tmp}/edgecloud-setup.XXXXXX")"
    printf '%s... ' "$what"
    if "$@" >"$log" 2>&1; then
        printf 'done (%d s)\n' $((SECONDS - t0))
        rm -f "$log"
    else
        rc=$?
        printf 'FAILED (exit %d)\n' "$rc"
        echo "---- output of: $* ----" >&2
        tail -n 60 "$log" >&2
        echo "---- (whole log: $log) ----" >&2
        exit "$rc"
    fi
}
