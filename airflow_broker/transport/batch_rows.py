"""The transmission-queue columns a delivery batch reads (:meth:`.Transport._take`), and
getters of them by position.

Only what delivery uses: a batch's rows are loaded by the thousand, and each column costs its
loading (three timestamps, the broker instance columns and the status, which delivery never
reads, are about two fifths of it). A row's
conversation columns repeat on each of its rows; the getters read them by position, a tenth of
a look-up by name.
"""

from __future__ import annotations

from operator import itemgetter

#: The transmission-queue columns of a batch's rows, first and in this order; the endpoint's
#: columns and the dialog security flags follow them (read by name, once a conversation).
BATCH_COLUMNS = (
    "id",
    "conversation_handle",
    "conversation_id",
    "is_initiator",
    "from_service_name",
    "to_service_name",
    "service_contract_name",
    "message_type_name",
    "message_sequence_number",
    "validation",
    "message_body",
    "lifetime",
    "attempts",
    "sealed",
)


def _at(*columns: str) -> itemgetter[tuple[object, ...]]:
    return itemgetter(*(BATCH_COLUMNS.index(c) for c in columns))


#: A row's columns a packet is made of, in the order of its fields.
packet_columns = _at(
    "conversation_id",
    "is_initiator",
    "from_service_name",
    "to_service_name",
    "message_sequence_number",
    "service_contract_name",
    "message_type_name",
    "validation",
    "message_body",
    "lifetime",
    "sealed",
)

#: A row's sequence number, message type and body.
message_columns = _at("message_sequence_number", "message_type_name", "message_body")

#: A row's ``sealed`` column.
sealed = itemgetter(BATCH_COLUMNS.index("sealed"))
