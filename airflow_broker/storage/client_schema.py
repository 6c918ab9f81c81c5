"""The views a client role works through: schema ``broker_client`` (PostgreSQL).

A role granted SEND on services and RECEIVE on queues (:mod:`airflow_broker.security.permissions`)
has no right on the broker's tables: raw SQL on ``broker_message`` fails for it. It has rights on
the views here, one per table the engine's verbs use, each named like its table
(:mod:`airflow_broker.storage.roles` puts this schema first on its ``search_path``, so the engine's
statements are the same for every role). A view reads its table with its owner's rights (the
broker's owner, who migrates) and shows the caller only the rows its grants allow, computed in
each statement from ``broker_permission`` (a grant or a revoke counts from the next statement;
membership of a role that holds a grant counts as holding it):

- definitions (services, queues, contracts, message types, routes, priorities) are read-only;
  a queue's row may be updated only by failure accounting (its rollback count; disabling it),
  and only on a queue the role may RECEIVE from;
- ``broker_message`` shows the messages of queues the role may RECEIVE from, and takes new
  ones only where a SEND of the role puts them (a conversation it may send on) or where
  failure handling does (its queues' dead-letter queues);
- conversation endpoints: those the role may send on (their queue is one it may RECEIVE from:
  it replies; or their far service is one it may SEND to), and their far endpoints in this
  database; conversation groups of those, and groups not used yet; the transmission queue,
  dedupe keys, leases of those conversations and queues.

Every check is on the view (``WITH CHECK OPTION``, an ``INSTEAD OF`` trigger on the queue view):
the owner's statements on the tables pay nothing for them. The schema is derived state: the
migrations drop it (a view would stop a column from changing) and :func:`rebuild`, at the end
of every ``migrate``, creates it again and grants it anew to every role holding a permission.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from airflow_broker.storage.roles import CLIENT_SCHEMA

C = CLIENT_SCHEMA

#: Read-only views of definitions (and the role's own grants: broker_permission).
READ_ONLY = (
    "broker_instance",
    "broker_message_type",
    "broker_contract",
    "broker_contract_message",
    "broker_service",
    "broker_service_contract",
    "broker_route",
    "broker_priority",
    "broker_routing_service",
)
#: Views a client role reads and writes (rows filtered and checked).
READ_WRITE = (
    "broker_message",
    "broker_conversation_group",
    "broker_conversation_endpoint",
    "broker_transmission_queue",
    "broker_dedupe",
    "broker_lease",
    "broker_receive_lease",
)
#: Columns whose sequences a client role's inserts draw from (a view inserts with the caller's
#: rights on a default's nextval).
SEQUENCES = (
    ("broker_message", "queuing_order"),
    ("broker_transmission_queue", "id"),
    ("broker_event", "id"),
)
#: SECURITY DEFINER functions a client role may call.
FUNCTIONS = (
    "broker_far_service(uuid)",
    "broker_lease_queue(uuid)",
    "broker_discard_messages(uuid)",
)

#: The endpoint ``{e}`` is one the caller may send on (SEND to its far service, or RECEIVE from
#: its queue or a queue whose dead-letter queue it is).
_OWNS = (
    "({e}.queue_id IN (SELECT queue_id FROM {c}.broker_granted_store) "
    "OR {e}.far_service IN (SELECT service_name FROM {c}.broker_granted_send))"
)


def _owns(alias: str) -> str:
    return _OWNS.format(e=alias, c=C)


def _ddl(b: str) -> list[str]:
    """The statements creating the schema's objects; ``b`` is the tables' schema (quoted)."""
    c = C
    rw = f"WITH (security_barrier) AS SELECT * FROM {b}"
    endpoint_visible = (
        f"{_owns('e')} OR EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint f "
        f"WHERE f.conversation_handle = e.far_handle AND {_owns('f')})"
    )
    own_handle = (
        "EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint e "
        "WHERE e.conversation_handle = {alias}.conversation_handle AND {owns})"
    )
    ddl = [
        # Who is asking: current_user, also inside this schema's SECURITY DEFINER functions.
        f"CREATE FUNCTION {c}.broker_caller() RETURNS name LANGUAGE sql STABLE "
        "SET search_path = pg_catalog AS "
        "$$ SELECT COALESCE(NULLIF(current_setting('role'), 'none'), session_user)::name $$",
        # The caller's grants, its own and those of roles it is a member of.
        f"CREATE VIEW {c}.broker_permission WITH (security_barrier) AS "
        f"SELECT p.permission, p.object_name, p.grantee, p.granted_at FROM {b}.broker_permission p "
        "WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = p.grantee "
        f"AND pg_catalog.pg_has_role({c}.broker_caller(), r.oid, 'MEMBER'))",
        f"CREATE VIEW {c}.broker_granted_receive AS SELECT q.queue_id FROM {b}.broker_queue q "
        f"JOIN {c}.broker_permission p ON p.permission = 'RECEIVE' AND p.object_name = q.name",
        f"CREATE VIEW {c}.broker_granted_store AS "
        f"SELECT queue_id FROM {c}.broker_granted_receive UNION "
        f"SELECT d.queue_id FROM {b}.broker_queue q JOIN {b}.broker_queue d "
        "ON d.name = q.dead_letter_queue "
        f"WHERE q.queue_id IN (SELECT queue_id FROM {c}.broker_granted_receive)",
        f"CREATE VIEW {c}.broker_granted_send AS SELECT p.object_name AS service_name "
        f"FROM {c}.broker_permission p WHERE p.permission = 'SEND'",
        *(f"CREATE VIEW {c}.{t} AS SELECT * FROM {b}.{t}" for t in READ_ONLY),
        f"CREATE VIEW {c}.broker_queue AS SELECT * FROM {b}.broker_queue",
        # Messages: taken where a SEND (or failure handling) of the caller puts them ...
        f"CREATE VIEW {c}.broker_message_store {rw}.broker_message m "
        f"WHERE m.queue_id IN (SELECT queue_id FROM {c}.broker_granted_store) "
        f"OR EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint d "
        "WHERE d.conversation_handle = m.conversation_handle AND d.queue_id = m.queue_id "
        f"AND ({_owns('d')} OR EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint f "
        f"WHERE f.conversation_handle = d.far_handle AND {_owns('f')}))) "
        "WITH CASCADED CHECK OPTION",
        # ... and shown only on the queues it may RECEIVE from.
        f"CREATE VIEW {c}.broker_message WITH (security_barrier) AS "
        f"SELECT * FROM {c}.broker_message_store m "
        f"WHERE m.queue_id IN (SELECT queue_id FROM {c}.broker_granted_receive)",
        f"CREATE VIEW {c}.broker_conversation_endpoint {rw}.broker_conversation_endpoint e "
        f"WHERE {endpoint_visible} WITH CASCADED CHECK OPTION",
        f"CREATE VIEW {c}.broker_conversation_group {rw}.broker_conversation_group g "
        f"WHERE g.queue_id IN (SELECT queue_id FROM {c}.broker_granted_store) "
        f"OR EXISTS (SELECT 1 FROM {c}.broker_conversation_endpoint e "
        "WHERE e.conversation_group_id = g.conversation_group_id) "
        f"OR NOT EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint e "
        "WHERE e.conversation_group_id = g.conversation_group_id) WITH CASCADED CHECK OPTION",
        f"CREATE VIEW {c}.broker_transmission_queue {rw}.broker_transmission_queue t "
        f"WHERE {own_handle.format(b=b, alias='t', owns=_owns('e'))} WITH CASCADED CHECK OPTION",
        # Dedupe keys of conversations the caller may send on (or not begun yet).
        f"CREATE VIEW {c}.broker_dedupe {rw}.broker_dedupe k "
        f"WHERE NOT EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint e "
        "WHERE e.conversation_handle = k.conversation_handle) "
        f"OR {own_handle.format(b=b, alias='k', owns=_owns('e'))} WITH CASCADED CHECK OPTION",
        *(
            f"CREATE VIEW {c}.{t} {rw}.{t} x WHERE x.queue_id IN "
            f"(SELECT queue_id FROM {c}.broker_granted_receive) WITH CASCADED CHECK OPTION"
            for t in ("broker_lease", "broker_receive_lease")
        ),
        f"CREATE VIEW {c}.broker_receive_commit AS SELECT * FROM {b}.broker_receive_commit",
        # Events: written (a queue disabled by poison handling), never read.
        f"CREATE VIEW {c}.broker_event AS SELECT * FROM {b}.broker_event WHERE false",
        # A queue's row: only failure accounting's changes, only on a queue it may RECEIVE from.
        f"""CREATE FUNCTION {c}.broker_queue_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    counted text[] := ARRAY['status', 'rollback_count', 'modified_at'];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM {c}.broker_granted_receive g WHERE g.queue_id = OLD.queue_id)
    THEN
        RAISE EXCEPTION 'role % has no RECEIVE permission on queue %',
            quote_literal({c}.broker_caller()), quote_literal(OLD.name)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF to_jsonb(NEW) - counted IS DISTINCT FROM to_jsonb(OLD) - counted
       OR (NEW.status AND NOT OLD.status) THEN
        RAISE EXCEPTION 'role % may not alter queue % (only the broker''s owner may)',
            quote_literal({c}.broker_caller()), quote_literal(OLD.name)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    UPDATE {b}.broker_queue
    SET status = NEW.status, rollback_count = NEW.rollback_count, modified_at = NEW.modified_at
    WHERE queue_id = OLD.queue_id;
    RETURN NEW;
END
$$""",
        f"CREATE TRIGGER broker_queue_update INSTEAD OF UPDATE ON {c}.broker_queue "
        f"FOR EACH ROW EXECUTE FUNCTION {c}.broker_queue_update()",
        # For precise errors: where a conversation the caller cannot see goes, which queue a
        # lease it cannot see holds.
        f"CREATE FUNCTION {c}.broker_far_service(handle uuid) RETURNS text LANGUAGE sql STABLE "
        "SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS "
        f"$$ SELECT far_service FROM {b}.broker_conversation_endpoint "
        "WHERE conversation_handle = handle $$",
        f"CREATE FUNCTION {c}.broker_lease_queue(token uuid) RETURNS text LANGUAGE sql STABLE "
        "SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS "
        f"$$ SELECT q.name FROM {b}.broker_lease l JOIN {b}.broker_queue q "
        "ON q.queue_id = l.queue_id WHERE l.token = $1 $$",
        # END CONVERSATION on a conversation whose queue the caller may not read: its messages
        # there go with it (the view does not show them to the caller).
        f"""CREATE FUNCTION {c}.broker_discard_messages(handle uuid) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM {b}.broker_conversation_endpoint e
                   WHERE e.conversation_handle = handle AND {_owns("e")}) THEN
        RAISE EXCEPTION 'role % may not end conversation %',
            quote_literal({c}.broker_caller()), handle
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    DELETE FROM {b}.broker_message m USING {b}.broker_conversation_endpoint e
    WHERE e.conversation_handle = handle AND m.conversation_handle = handle
      AND m.queue_id = e.queue_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$""",
    ]
    ddl += [
        f"REVOKE ALL ON FUNCTION {c}.{f} FROM PUBLIC" for f in (*FUNCTIONS, "broker_queue_update()")
    ]
    return ddl


def _tables_schema(conn: Connection) -> str:
    """The schema the broker tables live in, quoted."""
    schema: str = conn.execute(
        text(
            "SELECT quote_ident(n.nspname) FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE c.oid = to_regclass('broker_instance')"
        )
    ).scalar_one()
    return schema


def drop(conn: Connection) -> None:
    """Drop the client schema (before the migrations change the tables under it)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"DROP SCHEMA IF EXISTS {C} CASCADE"))


def rebuild(conn: Connection) -> None:
    """Create the client schema afresh for the tables as they are now, inside ``conn``'s
    transaction, and grant it to every role holding a permission (PostgreSQL; the caller
    holds the migration lock)."""
    if conn.dialect.name != "postgresql":
        return
    b = _tables_schema(conn)
    drop(conn)
    conn.execute(text(f"CREATE SCHEMA {C}"))
    for statement in _ddl(b):
        conn.execute(text(statement))
    roles = conn.execute(
        text(
            f"SELECT DISTINCT p.grantee FROM {b}.broker_permission p "
            "JOIN pg_roles r ON r.rolname = p.grantee ORDER BY 1"
        )
    ).scalars()
    for role in list(roles):
        grant_client(conn, role)


def _statements(conn: Connection, role: str, *, grant: bool) -> list[str]:
    b = _tables_schema(conn)
    r: str = conn.execute(text("SELECT quote_ident(:r)"), {"r": role}).scalar_one()
    sequences = [
        conn.execute(
            text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": f"{b}.{t}", "c": col}
        ).scalar_one()
        for t, col in SEQUENCES
    ]
    rights = [
        ("SCHEMA", C, "USAGE"),
        *(("TABLE", f"{C}.{t}", "SELECT") for t in (*READ_ONLY, "broker_permission")),
        ("TABLE", f"{C}.broker_queue", "SELECT, UPDATE"),
        *(("TABLE", f"{C}.{t}", "SELECT, INSERT, UPDATE, DELETE") for t in READ_WRITE),
        # Read by RECEIVE's look for a dead lease (storage.adapters); written by earlier versions.
        ("TABLE", f"{C}.broker_receive_commit", "SELECT, INSERT"),
        ("TABLE", f"{C}.broker_event", "SELECT, INSERT"),
        *(("SEQUENCE", seq, "USAGE") for seq in sequences if seq),
        *(("FUNCTION", f"{C}.{f}", "EXECUTE") for f in FUNCTIONS),
    ]
    if grant:
        return [f"GRANT {what} ON {kind} {obj} TO {r}" for kind, obj, what in rights]
    return [f"REVOKE {what} ON {kind} {obj} FROM {r}" for kind, obj, what in rights]


def grant_client(conn: Connection, role: str) -> None:
    """Let ``role`` use the client schema (what the views show it is up to its permissions)."""
    for statement in _statements(conn, role, grant=True):
        conn.execute(text(statement))


def revoke_client(conn: Connection, role: str) -> None:
    """Take the client schema away from ``role`` (its last permission went)."""
    for statement in _statements(conn, role, grant=False):
        conn.execute(text(statement))


def exists(conn: Connection) -> bool:
    """Whether the client schema is there (a migrated PostgreSQL database at head)."""
    return bool(conn.execute(text("SELECT to_regnamespace(:s) IS NOT NULL"), {"s": C}).scalar_one())


__all__ = [
    "FUNCTIONS",
    "READ_ONLY",
    "READ_WRITE",
    "drop",
    "exists",
    "grant_client",
    "rebuild",
    "revoke_client",
]
