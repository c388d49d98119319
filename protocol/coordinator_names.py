"""Names both sides of the coordinator's public address agree on, light to import (no grpc): the
admin commands declare their flags with them (`murmur admin --help` imports no grpc)."""

ADMIN_METADATA_KEY = "murmur-admin-key"
TLS_SERVER_NAME = "murmur-coordinator"  # the DNS SAN of the coordinator's certificate
ADMIN_CALL_TIMEOUT_S = 15.0  # `murmur admin --timeout`'s default
