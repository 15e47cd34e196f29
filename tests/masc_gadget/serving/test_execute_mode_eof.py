"""Execute mode (the module Gadgetron starts per stream, through gadgetron.external.Connection)
when the stream ends without a close message: it must return the open slices and stop, not spin."""

import socket
import threading

import ismrmrd
from gadgetron.external.connection import Connection

from masc_gadget.mrd.frames import ID_IMAGE, ConnectionClosed
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.gadget import masc
from masc_gadget.serving.host import Host
from masc_gadget.serving.models import ModelCache

from tests.scanner_streams import base_stream

CONFIG = ('<configuration><property name="policy" value="center-out"/><property name="initial" value="2"/>'
          '<property name="budget" value="6"/><property name="mar_checkpoint" value=""/>'
          '<property name="policy_checkpoint" value=""/></configuration>')


def test_a_stream_that_ends_without_a_close_gets_its_open_slice_and_the_module_returns():
    header, acquisitions = base_stream(16, 16, (200.0, 200.0, 5.0), slices=1)
    scanner_end, gadget_end = socket.socketpair()
    done = threading.Event()

    def module():
        masc(Connection(gadget_end), host=Host(cache=ModelCache()))
        done.set()
        gadget_end.close()

    scanner = MrdStream(scanner_end)
    scanner.send_config_text(CONFIG)
    scanner.send_header(header)
    thread = threading.Thread(target=module, daemon=True)
    thread.start()
    for acq in acquisitions[6:10]:  # four lines of the slice, then the scanner's side ends: no close message
        scanner.send_acquisition(acq)
    scanner_end.shutdown(socket.SHUT_WR)
    images = []
    try:
        while True:
            message = scanner.read_message()
            if message.id == ID_IMAGE:
                images.append(message.payload)
    except ConnectionClosed:
        pass
    assert done.wait(10), "the module did not return after the stream ended"
    assert [im.slice for im in images if im.image_series_index == 1] == [0]  # the open slice, finished
    assert isinstance(images[0], ismrmrd.Image) and images[0].data.shape[-1] == 16
