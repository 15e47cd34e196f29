"""The MRD (ISMRMRD v1) stream protocol: message ids, framing, and a thread-safe socket stream.

One module owns the wire format (house style rule 5). Everything is little-endian and every
message starts with a ``uint16`` id:

==========  ================  ======================================================
id          name              payload
==========  ================  ======================================================
1           config file       1024 bytes, the file name NUL padded
2           config text       ``uint32`` length + text (Gadgetron's XML config script)
3           header            ``uint32`` length + ISMRMRD XML header
4           close             nothing
5           text              ``uint32`` length + text (e.g. JSON parameters)
8           error             ``uint64`` length + text (Gadgetron's error message)
1008        acquisition       AcquisitionHeader (340 bytes), trajectory float32
                              [samples, dims], data complex64 [channels, samples]
1022        image             ImageHeader (198 bytes), ``uint64`` attribute length,
                              attribute XML (ismrmrd Meta), data [c, z, y, x]
1026        waveform          WaveformHeader (40 bytes), data uint32 [channels, samples]
1028        feedback          ``uint32`` length + name, ``uint32`` length + data (FIRE-style)
==========  ================  ======================================================

Reading is defensive: every length is checked against :class:`Limits` before the body is read
or allocated. Only framing is checked here; what the data mean is for the engine to judge.

One deliberate departure from the reference Python packages, towards the MRD spec and the C++
implementations (Gadgetron, ``gadgetron_ismrmrd_client``): ``DATATYPE_INT`` images travel as
int32 (ISMRMRD's ``ISMRMRD_INT``). The ismrmrd Python package maps that type to numpy's platform
``int`` (int64 on Linux) and would write 8 bytes per pixel. On reading, the pixels are widened to
the int64 array that the ismrmrd Python ``Image`` holds.

:func:`frame_image` (like ``Image.serialize_into``) sets the image's ``attribute_string_len`` to
the UTF-8 length of its attribute string, so that a sent image equals the one read back.
"""

from __future__ import annotations

import io
import select
import socket
import threading
import time
from typing import Callable

import ismrmrd
import numpy as np

from masc_gadget.mrd import tcp
from masc_gadget.mrd.frames import (
    ACQUISITION_HEADER_BYTES,
    IMAGE_HEADER_BYTES,
    IMAGE_WIRE_DTYPES,
    MESSAGE_ID,
    SAMPLE_DTYPE,
    TEXT_LENGTH,
    TRAJECTORY_DTYPE,
    UINT32,
    UINT64,
    WAVEFORM_DTYPE,
    WAVEFORM_HEADER_BYTES,
    CONFIG_FILE_BYTES,
    ConnectionClosed,
    decode_text,
    Feedback,
    frame_acquisition,
    frame_close,
    frame_config_file,
    frame_config_text,
    frame_error,
    frame_feedback,
    frame_header,
    frame_image,
    frame_message,
    frame_text,
    frame_waveform,
    ID_ACQUISITION,
    ID_CLOSE,
    ID_CONFIG_FILE,
    ID_CONFIG_TEXT,
    ID_ERROR,
    ID_FEEDBACK,
    ID_HEADER,
    ID_IMAGE,
    ID_TEXT,
    ID_WAVEFORM,
    Limits,
    Message,
    MESSAGE_NAMES,
    ProtocolError,
    ReadTimeout,
)

__all__ = ["EAGER_BYTES", "MrdStream"]

# --------------------------------------------------------------------------------------------
# The stream

EAGER_BYTES = 64 << 10
"""Bytes of a field allocated before they arrive (64 KiB: a readout line of 1024 samples x 8 coils fits); a
longer field's buffer doubles as it fills, so a length a peer only announces costs at most this much."""


class MrdStream:
    """MRD messages over a connected stream socket (TCP or AF_UNIX).

    Thread-safe: one thread may read while others send. Every send is a single ``sendall`` of a
    whole frame under a lock, so frames from different threads never interleave; reads take
    their own lock.

    Socket timeouts: a timeout before the first byte of a message leaves the stream usable (call
    ``read_message`` again); a timeout, error or limit violation in the middle of a frame leaves
    the stream out of step with the peer, and every later ``read_message`` raises ProtocolError
    (likewise a failed ``sendall`` makes later sends raise). A ProtocolError raised after the
    whole frame was read (invalid UTF-8, malformed image attributes) does not: the next message
    can still be read. ``read_message`` also takes deadlines that a peer dripping single bytes
    cannot renew (:class:`ReadTimeout`).
    """

    def __init__(self, sock: socket.socket, limits: Limits = Limits(), quick_ack: bool = False,
                 accept: frozenset[int] | None = None):
        self.sock = sock
        self.limits = limits
        self.accept = accept  # message ids this side reads; others are refused at their id
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._in_frame = False  # bytes of the current frame were consumed and more are owed
        self.bytes_received = 0  # every byte read so far (a server tells a slow client from an idle one)
        self._deadline: float | None = None  # time.monotonic() by which the current read must end
        self._message_timeout: float | None = None
        self._idle: float | None = None  # the socket's own timeout, restored after a timed read
        self._read_broken: str | None = None
        self._write_broken: str | None = None
        self.quick_ack = quick_ack  # TCP_QUICKACK before each read: peer without TCP_NODELAY
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # AF_UNIX (socketpair): no Nagle to turn off
            pass
        self._readers: dict[int, Callable[[], object]] = {
            ID_CONFIG_FILE: self._read_config_file,
            ID_CONFIG_TEXT: lambda: self._read_text(ID_CONFIG_TEXT),
            ID_HEADER: lambda: self._read_text(ID_HEADER),
            ID_CLOSE: self._frame_done,
            ID_TEXT: lambda: self._read_text(ID_TEXT),
            ID_ERROR: lambda: self._read_text(ID_ERROR),
            ID_ACQUISITION: self._read_acquisition,
            ID_IMAGE: self._read_image,
            ID_WAVEFORM: self._read_waveform,
            ID_FEEDBACK: self._read_feedback,
        }

    @property
    def _sock(self) -> socket.socket:
        """Alias of :attr:`sock` (some tests write raw bytes through ``stream._sock``)."""
        return self.sock

    def __enter__(self) -> "MrdStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---------------------------------------------------------------------------- reading

    def read_message(self, deadline: float | None = None, message_timeout: float | None = None) -> Message:
        """Read exactly one message (blocking), and nothing beyond it.

        ``deadline`` (``time.monotonic()``): the whole message must have arrived by then;
        ``message_timeout``: the rest must follow its first byte within this many seconds. Either
        raises :class:`ReadTimeout`, however slowly bytes trickle in; the socket's own timeout
        still bounds each silence (``socket.timeout``), and is restored afterwards.

        Raises ConnectionClosed (``clean`` True at a message boundary, False mid-frame),
        ProtocolError for an unknown id or a field over :class:`Limits`.
        """
        with self._read_lock:
            if self._read_broken is not None:
                raise ProtocolError(
                    f"stream is out of step after an earlier error: {self._read_broken}"
                )
            timed = deadline is not None or message_timeout is not None
            self._idle = self.sock.gettimeout() if timed else None
            self._deadline, self._message_timeout = deadline, message_timeout
            try:
                return self._read_one()
            finally:
                self._deadline = self._message_timeout = None
                if timed:
                    try:
                        self.sock.settimeout(self._idle)
                    except OSError:  # closed meanwhile
                        pass

    def _read_one(self) -> Message:
        """One message (read lock held); a mid-frame failure leaves the stream out of step."""
        self._in_frame = False
        try:
            raw = self._recv_exact(MESSAGE_ID.size, "message id", at_boundary=True)
            message_id = MESSAGE_ID.unpack(raw)[0]
            reader = self._readers.get(message_id)
            if reader is None:  # its length is unknown: the stream cannot be resynchronised
                raise ProtocolError(f"unknown message id {message_id}")
            if self.accept is not None and message_id not in self.accept:
                raise ProtocolError(f"message {message_id} ({MESSAGE_NAMES[message_id]}) is not accepted here; "
                                    "accepted: " + ", ".join(f"{i} ({MESSAGE_NAMES[i]})" for i in sorted(self.accept)))
            return Message(message_id, reader())
        except ConnectionClosed as error:
            if not error.clean:
                self._read_broken = str(error)
            raise
        except BaseException as error:
            if self._in_frame:  # part of a frame was consumed: out of step with the peer
                self._read_broken = f"{type(error).__name__}: {error}"
            raise

    def _recv_exact(self, n: int, what: str, at_boundary: bool = False) -> bytearray:
        """Receive exactly n bytes (n already checked against the limits); loop on short reads.
        Beyond :data:`EAGER_BYTES` the buffer grows as bytes arrive, so a length a peer
        announces costs memory only once the peer has sent that much."""
        buffer = bytearray(min(n, EAGER_BYTES))
        got = 0
        while got < n:
            if got == len(buffer):
                buffer.extend(bytes(min(len(buffer), n - got)))  # doubles, up to n
            view = memoryview(buffer)
            try:
                count = self._recv_into(view[got:], len(buffer) - got, what)
            finally:
                view.release()
            if count == 0:
                if at_boundary and got == 0:
                    raise ConnectionClosed("connection closed by the peer", clean=True)
                raise ConnectionClosed(
                    f"truncated frame: expected {n} bytes of {what}, got {got}", clean=False
                )
            got += count
            self._in_frame = True
        return buffer

    def _recv_into(self, view: memoryview, n: int, what: str) -> int:
        """``sock.recv_into`` under the deadlines of :meth:`read_message`; the message's first
        bytes start its ``message_timeout``."""
        if self.quick_ack:
            tcp.quick_ack(self.sock)
        if self._deadline is None:
            count = self.sock.recv_into(view, n)
        else:
            count = self._recv_before_deadline(view, n, what)
        self.bytes_received += count
        if count and not self._in_frame and self._message_timeout is not None:
            end = time.monotonic() + self._message_timeout
            self._deadline = end if self._deadline is None else min(self._deadline, end)
        return count

    def _recv_before_deadline(self, view: memoryview, n: int, what: str) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise ReadTimeout(f"{what}: not received before the deadline", self._in_frame)
        self.sock.settimeout(remaining if self._idle is None else min(self._idle, remaining))
        try:
            return self.sock.recv_into(view, n)
        except socket.timeout:
            if time.monotonic() >= self._deadline - 1e-3:
                raise ReadTimeout(f"{what}: not received before the deadline", self._in_frame) from None
            raise

    def _frame_done(self) -> None:
        """Mark the current frame as completely read (later errors leave the stream usable)."""
        self._in_frame = False

    def _check(self, what: str, value: int, limit: int) -> None:
        if value > limit:
            raise ProtocolError(f"{what} {value} exceeds the limit {limit}")

    def _read_config_file(self) -> str:
        raw = self._recv_exact(CONFIG_FILE_BYTES, "config file name")
        self._frame_done()
        return decode_text(raw.split(b"\x00", 1)[0], "config file")

    def _read_text(self, message_id: int) -> str:
        name = MESSAGE_NAMES[message_id]
        length_format = TEXT_LENGTH[message_id]
        length = length_format.unpack(self._recv_exact(length_format.size, f"{name} length"))[0]
        self._check(f"{name}: length", length, self.limits.max_text_bytes)
        raw = self._recv_exact(length, name)
        self._frame_done()
        return decode_text(raw, name)

    def _read_feedback(self) -> Feedback:
        name = self._read_blob("feedback name", 1024)
        data = self._read_blob("feedback data", self.limits.max_text_bytes)
        self._frame_done()
        return Feedback(decode_text(name, "feedback name"), bytes(data))

    def _read_blob(self, what: str, limit: int) -> bytearray:
        """``uint32`` length (at most ``limit``) + that many bytes, inside a frame."""
        length = UINT32.unpack(self._recv_exact(UINT32.size, f"{what} length"))[0]
        self._check(f"{what}: length", length, limit)
        return self._recv_exact(length, what)

    def _read_acquisition(self) -> ismrmrd.Acquisition:
        head = self._recv_exact(ACQUISITION_HEADER_BYTES, "acquisition header")
        header = ismrmrd.AcquisitionHeader.from_buffer_copy(head)
        limits = self.limits
        samples, channels = header.number_of_samples, header.active_channels
        dims = header.trajectory_dimensions
        self._check("acquisition: number_of_samples", samples, limits.max_samples)
        self._check("acquisition: active_channels", channels, limits.max_channels)
        self._check(
            "acquisition: trajectory_dimensions", dims, limits.max_trajectory_dimensions
        )
        size = samples * (dims * TRAJECTORY_DTYPE.itemsize + channels * SAMPLE_DTYPE.itemsize)
        body = self._recv_exact(size, "acquisition data")
        self._frame_done()
        return ismrmrd.Acquisition.deserialize_from(io.BytesIO(head + body).read)

    def _read_image(self) -> ismrmrd.Image:
        head = self._recv_exact(IMAGE_HEADER_BYTES, "image header")
        header = ismrmrd.ImageHeader.from_buffer_copy(head)
        wire_dtype = IMAGE_WIRE_DTYPES.get(header.data_type)
        if wire_dtype is None:
            raise ProtocolError(
                f"image: data_type {header.data_type} is not an ISMRMRD data type "
                f"(known: {sorted(IMAGE_WIRE_DTYPES)})"
            )
        x, y, z = header.matrix_size
        channels = header.channels
        size = channels * x * y * z * wire_dtype.itemsize
        if size > self.limits.max_image_bytes:
            raise ProtocolError(
                f"image: data size {x}x{y}x{z} x {channels} channels x {wire_dtype.itemsize} "
                f"bytes = {size} bytes exceeds the limit {self.limits.max_image_bytes}"
            )
        length = UINT64.unpack(self._recv_exact(UINT64.size, "image attribute length"))[0]
        self._check("image: attribute length", length, self.limits.max_text_bytes)
        attributes = self._recv_exact(length, "image attributes")
        pixels = self._recv_exact(size, "image data")
        self._frame_done()
        text = decode_text(attributes, "image attributes")
        try:
            image = ismrmrd.Image(head=head, attribute_string=text)
        except (SyntaxError, AssertionError, AttributeError) as error:  # ET.ParseError: SyntaxError
            raise ProtocolError(
                f"image: attribute string is not ismrmrd Meta XML ({type(error).__name__}: {error})"
            ) from None
        image.data.ravel()[:] = np.frombuffer(pixels, dtype=wire_dtype)
        return image

    def _read_waveform(self) -> ismrmrd.Waveform:
        head = self._recv_exact(WAVEFORM_HEADER_BYTES, "waveform header")
        header = ismrmrd.WaveformHeader.from_buffer_copy(head)
        samples, channels = header.number_of_samples, header.channels
        if samples * channels > self.limits.max_waveform_samples:
            raise ProtocolError(
                f"waveform: number_of_samples {samples} x channels {channels} = "
                f"{samples * channels} exceeds the limit {self.limits.max_waveform_samples}"
            )
        data = self._recv_exact(samples * channels * WAVEFORM_DTYPE.itemsize, "waveform data")
        self._frame_done()
        waveform = ismrmrd.Waveform(head)
        waveform.data.ravel()[:] = np.frombuffer(data, dtype=WAVEFORM_DTYPE)
        return waveform

    # ---------------------------------------------------------------------------- sending

    def send_frame(self, frame: bytes) -> None:
        """Send one already framed message with a single ``sendall`` under the write lock."""
        with self._write_lock:
            if self._write_broken is not None:
                raise OSError(
                    f"stream cannot send after an earlier failed send: {self._write_broken}"
                )
            try:
                self.sock.sendall(frame)
            except BaseException as error:
                self._write_broken = f"{type(error).__name__}: {error}"
                raise

    def send_message(self, message: Message) -> None:
        """Send any :class:`Message` (forwarding what :meth:`read_message` returned)."""
        self.send_frame(frame_message(message))

    def send_config_file(self, name: str) -> None:
        """Id 1: the config by name (1024 bytes, NUL padded)."""
        self.send_frame(frame_config_file(name))

    def send_config_text(self, text: str, nul_terminate: bool = False) -> None:
        """Id 2: the config script."""
        self.send_frame(frame_config_text(text, nul_terminate))

    def send_header(self, xml: str, nul_terminate: bool = False) -> None:
        """Id 3: the ISMRMRD XML header."""
        self.send_frame(frame_header(xml, nul_terminate))

    def send_text(self, text: str, nul_terminate: bool = False) -> None:
        """Id 5: free text (JSON parameters)."""
        self.send_frame(frame_text(text, nul_terminate))

    def send_error(self, text: str) -> None:
        """Id 8: an error message (uint64 length)."""
        self.send_frame(frame_error(text))

    def send_close(self) -> None:
        """Id 4: end of stream."""
        self.send_frame(frame_close())

    def send_acquisition(self, acq: ismrmrd.Acquisition) -> None:
        """Id 1008."""
        self.send_frame(frame_acquisition(acq))

    def send_image(self, image: ismrmrd.Image) -> None:
        """Id 1022."""
        self.send_frame(frame_image(image))

    def send_waveform(self, waveform: ismrmrd.Waveform) -> None:
        """Id 1026."""
        self.send_frame(frame_waveform(waveform))

    def send_feedback(self, feedback: Feedback) -> None:
        """Id 1028."""
        self.send_frame(frame_feedback(feedback))

    # ---------------------------------------------------------------------------- closing

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def interrupt(self, frame: bytes | None = None, lock_timeout: float = 0.2) -> bool:
        """End the stream from another thread (e.g. a server shutting down), never blocking for
        long: send ``frame`` (e.g. :func:`frame_close`) only if no other send holds the stream
        for more than ``lock_timeout`` s and the socket takes it at once, then shut the socket
        down, which wakes a reader blocked on it. Later sends raise OSError; :meth:`close` still
        closes the socket. Returns whether ``frame`` went out whole."""
        sent = False
        locked = frame is not None and self._write_lock.acquire(timeout=lock_timeout)
        try:
            if locked and self._write_broken is None:
                poller = select.poll()  # send only what the socket takes at once
                poller.register(self.sock.fileno(), select.POLLOUT)
                if poller.poll(0):
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT) == len(frame)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        finally:
            self._write_broken = "the stream was interrupted"
            if locked:
                self._write_lock.release()
        return sent

    def close(self) -> None:
        """Shut the socket down and close it (idempotent; unblocks a reader in another thread)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        self.sock.close()
