#!/bin/sh
# Creates Temporal's databases in PostgreSQL and brings their schemas to the version of the
# temporal-sql-tool that runs this (the temporalio/admin-tools image: keep its tag equal to the
# server's). Safe to run again: existing databases are kept, and only missing schema versions
# are applied, so it also upgrades the schema after a tag change.
#
# Settings (environment): SQL_HOST, SQL_PORT, SQL_USER, SQL_PASSWORD (read by temporal-sql-tool
# itself), DBNAME and VISIBILITY_DBNAME.
set -eu

: "${SQL_HOST:?SQL_HOST is required}"
: "${SQL_USER:?SQL_USER is required}"
: "${SQL_PASSWORD:?SQL_PASSWORD is required}"
SQL_PORT=${SQL_PORT:-5432}
export SQL_PORT
SCHEMA_DIR=/etc/temporal/schema/postgresql/v12

setup() {
    database=$1
    versioned=$2
    echo "temporal-sql-tool: database $database"
    temporal-sql-tool --plugin postgres12 --db "$database" create
    temporal-sql-tool --plugin postgres12 --db "$database" setup-schema -v 0.0
    temporal-sql-tool --plugin postgres12 --db "$database" update-schema -d "$SCHEMA_DIR/$versioned/versioned"
}

setup "${DBNAME:-temporal}" temporal
setup "${VISIBILITY_DBNAME:-temporal_visibility}" visibility
echo "Temporal schemas are up to date"
