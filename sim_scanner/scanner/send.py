"""``masc send``: an MRD file to a server in open loop, and what comes back into an MRD file.

What python-ismrmrd-server's ``client.py`` and ``gadgetron_ismrmrd_client`` do, for any server that
speaks MRD (``masc serve``, Gadgetron, python-ismrmrd-server): the configuration (a name, or a
script such as ``configs/gadgetron/masc_external.xml``), the file's ISMRMRD header, optional JSON
parameters, every acquisition of the file in its order, the close; a reader thread collects the
images and texts the server sends back until it closes. The images are written to an ISMRMRD file
(one image group per series, ``image_1`` the MAR series of ``masc serve``, ``image_2`` its
zero-filled one), with the header that was sent, so that ``masc view`` (or any MRD tool) reads them.
Nothing is sent that the file does not hold; the server's settings decide the rest.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ismrmrd

from masc_gadget.mrd import tcp
from masc_gadget.mrd.frames import ID_CLOSE, ID_ERROR, ID_IMAGE, ID_TEXT, ConnectionClosed, ProtocolError
from masc_gadget.mrd.protocol import MrdStream
from sim_scanner.dataset.streams import read_stream, write_group

log = logging.getLogger(__name__)

__all__ = ["SendResult", "send_file", "write_images"]


@dataclass
class SendResult:
    """What one ``masc send`` got back."""

    sent: int
    """Acquisitions sent."""
    images: list[ismrmrd.Image] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """The server's ``MASC warning:`` texts (a setting it did not apply)."""
    errors: list[str] = field(default_factory=list)
    """Its other texts and error messages, and what went wrong on the connection."""
    closed: bool = False
    """Whether the server closed the stream with its close message (id 4)."""
    texts: list[str] = field(default_factory=list)
    """Every text message, in order."""
    header: str = ""
    """The ISMRMRD header that was sent."""

    def by_series(self) -> dict[int, int]:
        """Images returned per series index."""
        out: dict[int, int] = {}
        for image in self.images:
            out[int(image.image_series_index)] = out.get(int(image.image_series_index), 0) + 1
        return dict(sorted(out.items()))


def _address(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--server must be HOST:PORT, got {server!r}")
    return host, int(port)


def send_file(path: str | os.PathLike, server: str, group: str = "dataset", config_name: str = "default",
              config_xml: str | os.PathLike = "", params: dict[str, Any] | None = None,
              timeout_s: float = 120.0, connect_timeout_s: float = 10.0) -> SendResult:
    """Send the ISMRMRD group ``group`` of ``path`` to ``server`` (HOST:PORT) in open loop (module
    docstring) and collect what comes back. ``config_xml``: a configuration script file sent
    instead of the name; ``params``: JSON parameters sent after the header (``{"token": ...}``
    for a server that needs one). ValueError for a file that cannot be read; ConnectionError when
    the server cannot be reached. A server that stops answering for ``timeout_s`` ends the wait."""
    header, acquisitions = read_stream(path, group)
    script = Path(config_xml).read_text() if config_xml else ""
    host, port = _address(server)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as err:
        raise ConnectionError(f"cannot connect to {host}:{port}: {err} (is the server running?)") from None
    tcp.no_delay(sock)
    sock.settimeout(timeout_s)
    stream = MrdStream(sock, quick_ack=True)
    result = SendResult(sent=0, header=header)
    done = threading.Event()

    def read() -> None:
        try:
            while True:
                message = stream.read_message()
                if message.id == ID_IMAGE:
                    result.images.append(message.payload)
                elif message.id in (ID_TEXT, ID_ERROR):
                    text = str(message.payload).strip("\x00").strip()
                    result.texts.append(text)
                    (result.warnings if text.startswith("MASC warning:") else result.errors).append(text)
                elif message.id == ID_CLOSE:
                    result.closed = True
                    return
        except ConnectionClosed:
            return
        except socket.timeout:
            result.errors.append(f"the server sent nothing for {timeout_s:g} s")
        except (ProtocolError, OSError) as err:
            result.errors.append(f"reading from the server: {err}")
        finally:
            done.set()

    reader = threading.Thread(target=read, name="masc-send-reader", daemon=True)
    reader.start()
    try:
        if script:
            stream.send_config_text(script)
        else:
            stream.send_config_file(config_name)
        stream.send_header(header)
        if params:
            stream.send_text(json.dumps(params))
        for acq in acquisitions:
            if done.is_set():  # the server ended the stream: nothing more is read
                break
            stream.send_acquisition(acq)
            result.sent += 1
        stream.send_close()
    except OSError as err:
        result.errors.append(f"sending to the server: {err}")
    reader.join(timeout_s)
    stream.close()
    if not done.is_set():
        result.errors.append(f"the server did not close the stream within {timeout_s:g} s of the close")
    return result


def write_images(path: str | os.PathLike, images: list[ismrmrd.Image], header: str, group: str = "out") -> Path:
    """The images in an ISMRMRD file: ``group`` holds the header and one image variable per series
    (``image_<series>``); an existing group is replaced, the file appears only once complete
    (:func:`sim_scanner.dataset.streams.write_group`)."""
    def fill(dataset: ismrmrd.Dataset) -> None:
        dataset.write_xml_header(header)
        for image in images:
            dataset.append_image(f"image_{int(image.image_series_index)}", image)

    return write_group(path, group, fill)
