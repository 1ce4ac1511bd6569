"""The finished responses kept for `previous_response_id` and GET /v1/responses/{id}.

Stateless unless `store: true`. A stored response keeps its whole conversation (the input items of the chain it
continues, without instructions) and its output items, in a least-recently-used store of
ServerConfig.responses_store_size responses (reading one counts as a use); nothing survives a restart. An id the
store does not hold is a 404, `StoredResponseNotFoundError`. The store knows nothing of how a response was made.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenriver.server.responses_protocol import INPUT_ITEM_MODELS, InputItem, OutputItem, ResponseObject


@dataclass
class StoredResponse:
    """A finished response and the conversation it answered: what previous_response_id continues."""

    response: ResponseObject
    # The conversation this response answered, as input items (earlier responses' included, instructions not).
    conversation: list[InputItem]

    def continued(self) -> list[InputItem]:
        """The conversation with this response's output: what a request naming it as previous_response_id
        continues."""
        return [*self.conversation, *(as_input_item(item) for item in self.response.output)]


class ResponseStore:
    """The last `max_size` stored responses, least recently used evicted first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response.id] = stored
        self._responses.move_to_end(stored.response.id)
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def not_found_message(self, response_id: str) -> str:
        return (
            f"no stored response {response_id!r}: only responses created with store: true are kept (the last "
            f"{self.max_size} of them, until the server restarts)"
        )


def as_input_item(item: OutputItem) -> InputItem:
    """An output item as the input item a client would echo back."""
    data = item.model_dump(mode="json")
    return INPUT_ITEM_MODELS[data["type"]].model_validate(data)


class StoredResponseNotFoundError(Exception):
    """A response id the store does not hold (evicted, never stored, or from before a restart): a 404."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
