"""The upstream client's own reading of chunked bodies (controller/gateway/upstream.py)."""

from __future__ import annotations

import asyncio

import pytest

from controller.gateway.upstream import UpstreamConnection, whole_chunks

ONE = b"data: {}\n\n"
FRAMED = b"%x\r\n%s\r\n" % (len(ONE), ONE)


def test_whole_chunks_accepts_only_complete_chunks() -> None:
    assert whole_chunks(FRAMED) == (ONE, False)
    assert whole_chunks(FRAMED * 3) == (ONE * 3, False)
    assert whole_chunks(FRAMED + b"0\r\n\r\n") == (ONE, True), "ends the body"
    assert whole_chunks(b"0\r\n\r\n") == (b"", True)
    assert whole_chunks(FRAMED[:-1]) is None, "cut before the chunk's CRLF"
    assert whole_chunks(FRAMED + FRAMED[:4]) is None, "a second chunk cut short"
    assert whole_chunks(b"0\r\n\r") is None, "the end cut short"
    assert whole_chunks(b"0\r\nx-trailer: 1\r\n\r\n") is None, "trailers: parsed"
    assert whole_chunks(b"a;ext=1\r\n0123456789\r\n") is None, "extensions: parsed"
    assert whole_chunks(b"0x3\r\nabc\r\n") is None
    assert whole_chunks(b" 3\r\nabc\r\n") is None
    assert whole_chunks(b"") is None


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "reads",
    [
        [FRAMED, FRAMED, b"0\r\n\r\n"],  # one read per chunk, as vLLM writes them
        [FRAMED, FRAMED + b"0\r\n\r\n"],  # the last event and the end in one read
        [FRAMED[:5], FRAMED[5:] + FRAMED, b"0\r", b"\n\r\n"],  # cut anywhere: parsed
        [FRAMED, FRAMED, b"0\r\nx-trailer: 1\r\n\r\n"],  # trailers: parsed
    ],
)
def test_pipe_delivers_every_byte_and_ends_once_however_reads_fall(reads: list[bytes]) -> None:
    async def run() -> tuple[list[bytes], list[bytes], list[bytes]]:
        connection = UpstreamConnection()
        connection.connection_made(_Transport())  # type: ignore[arg-type]
        sunk: list[bytes] = []
        raw: list[bytes] = []
        ends: list[bytes] = []
        for _ in range(2):  # the same connection twice: keep-alive after each ending
            connection.send(b"GET / HTTP/1.1\r\n\r\n")
            connection.data_received(HEAD)
            assert (await connection.head()).status == 200
            piping = asyncio.ensure_future(
                connection.pipe(sunk.append, lambda r, p: raw.append(p) or True, ends.append)
            )
            await asyncio.sleep(0)
            for data in reads:
                connection.data_received(data)
            await piping
            assert connection.reusable
        return sunk, raw, ends

    sunk, raw, ends = asyncio.run(run())
    events = b"".join(reads).count(ONE)
    assert b"".join(sunk + raw + ends) == ONE * events * 2
    assert len(ends) == 2
