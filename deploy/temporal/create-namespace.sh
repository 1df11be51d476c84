#!/bin/sh
# Creates the namespace the worker uses and registers the custom search attributes of outbox
# shard workflows in it (the `temporal` CLI of the temporalio/admin-tools image). Safe to run
# again: an existing namespace is kept, and an attribute that exists with the same type is left
# as it is.
#
# Settings (environment): TEMPORAL_ADDRESS and TEMPORAL_NAMESPACE (as for the worker),
# RETENTION (how long closed workflows are kept).
set -eu

: "${TEMPORAL_ADDRESS:?TEMPORAL_ADDRESS is required}"
NAMESPACE=${TEMPORAL_NAMESPACE:-default}
RETENTION=${RETENTION:-72h}

# The search attributes of workflows/models.py, one per line: NAME TYPE.
SEARCH_ATTRIBUTES='
OutboxScope Keyword
OutboxShardKey Keyword
OutboxState Keyword
OutboxBlockedCategory Keyword
OutboxBlockedSince Datetime
'

# retry DESCRIPTION COMMAND...: runs COMMAND until it succeeds, 60 tries 2 s apart.
retry() {
    what=$1
    shift
    tries=0
    until "$@"; do
        tries=$((tries + 1))
        if [ "$tries" -ge 60 ]; then
            echo "gave up: $what" >&2
            return 1
        fi
        echo "waiting: $what (try $tries)"
        sleep 2
    done
}

ensure_namespace() {
    temporal operator namespace describe --namespace "$NAMESPACE" >/dev/null 2>&1 \
        || temporal operator namespace create --namespace "$NAMESPACE" --retention "$RETENTION"
}

retry "Temporal at $TEMPORAL_ADDRESS" temporal operator cluster health
retry "namespace $NAMESPACE" ensure_namespace

# One `create` for all of them: --name A --type T --name B --type U ...
set --
while read -r name type; do
    [ -n "$name" ] || continue
    set -- "$@" --name "$name" --type "$type"
done <<EOF
$SEARCH_ATTRIBUTES
EOF
# A namespace just created can take a few seconds to reach every frontend: retry.
retry "search attributes in $NAMESPACE" \
    temporal operator search-attribute create --namespace "$NAMESPACE" "$@"
temporal operator search-attribute list --namespace "$NAMESPACE"
