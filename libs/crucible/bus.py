"""The bus: a thin, typed layer over nats-py and JetStream.

One way to do each thing:
- `publish` puts a message on a stream, de-duplicated by `Nats-Msg-Id`; a payload over the claim-check
  threshold goes to the object store and the message carries its reference.
- `consume` runs a durable pull consumer with explicit ack: ack after the handler returns, dead-letter
  (with the reason) a message that cannot be decoded or raises `ContractError`, hold a message whose work
  finds a dependency `Unavailable` (see `crucible.outage`) and try it again until it answers, and nak
  with a back-off when the handler fails otherwise, dead-lettering it after `max_deliver` deliveries.
  Long work keeps its message with `Delivery.keep_alive` (the ack deadline is extended until it is settled).
- `request` / `serve` are request/reply on an endpoint declared once (`crucible.contracts.endpoints`),
  with deadlines; errors travel back as a typed error reply. `serve` runs at most `concurrency` handlers
  of an endpoint at once (`serve_concurrency` by default); the requests beyond wait their turn. It counts
  every request and its latency per subject (`crucible_bus_requests_total`, `..._request_seconds`), and
  keeps the handlers running and the requests waiting (`crucible_bus_requests_in_flight`, `..._waiting`).
  A request nobody answers, or answered `busy`, `shutting_down` or `unavailable`, raises `Unavailable`.
- `latest` / `watch` read the newest message on a subject and follow new ones (weight announcements).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from prometheus_client import Counter, Gauge, Histogram

from crucible.contracts import ContractError, access, decode, encode, subjects
from crucible.contracts.endpoints import Endpoint
from crucible.contracts.keys import bus_claim_prefix
from crucible.contracts.messages import DeadLetter, Message, ObjectRef
from crucible.objectstore import IntegrityError, ObjectNotFound, ObjectStore
from crucible.outage import Unavailable, ride_out
from crucible.settings import CommonSettings

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
log = structlog.get_logger("crucible.bus")

CLAIM_HEADER = "Crucible-Claim"
ERROR_HEADER = "Crucible-Error"
DEDUP_WINDOW_S = 6 * 3600.0
CONNECT_ATTEMPTS = 5
NO_RESPONDERS_GRACE_S = 0.5
HOLD_BEAT_S = 5.0
"""Ack-deadline extension while a message is held through an outage; a third of the consumer's ack wait
where that is shorter."""
_VIOLATION = re.compile(
    r'permissions violation for (?:publish|subscription) to "(?P<subject>[^"]+)"', re.IGNORECASE
)
TRANSIENT_CODES = frozenset({"busy", "shutting_down", "unavailable"})
"""Error codes of a reply that say the service cannot do it now, not that the request is wrong."""

REQUESTS = Counter(
    "crucible_bus_requests_total",
    "Requests answered, by subject and result (ok or the error code)",
    ["subject", "result"],
)
REQUEST_SECONDS = Histogram(
    "crucible_bus_request_seconds",
    "Time to answer a request, by subject",
    ["subject"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
)
IN_FLIGHT = Gauge("crucible_bus_requests_in_flight", "Requests being handled now, by subject", ["subject"])
WAITING = Gauge(
    "crucible_bus_requests_waiting",
    "Requests waiting for a handler (the subject's limit is reached), by subject",
    ["subject"],
)
DEFAULT_SERVE_CONCURRENCY: int = CommonSettings.model_fields["serve_concurrency"].default


class BusError(RuntimeError):
    """The bus could not do what was asked."""


class BusUnavailable(BusError, Unavailable):
    """The server, or the service asked, cannot be reached now."""


class BusRefused(BusError):
    """The server refused this identity the subject (`crucible.contracts.access`): a bug or a forgery, not
    an outage, so nothing waits it out."""


class BusTimeout(BusUnavailable):
    """No reply within the deadline: nobody serves the subject, or the server is overloaded."""


class RemoteError(BusError):
    """The service that answered a request reported an error."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class RemoteUnavailable(RemoteError, Unavailable):
    """The service answered that it cannot do it now (`TRANSIENT_CODES`)."""


class RequestError(Exception):
    """Raised by a request handler to answer a clear error (bad input, unknown id, busy)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class _ErrorReply(msgspec.Struct):
    code: str
    detail: str


_RETENTION = {"limits": RetentionPolicy.LIMITS, "work_queue": RetentionPolicy.WORK_QUEUE}


def _stream_config(stream: subjects.Stream) -> StreamConfig:
    return StreamConfig(
        name=stream.name,
        subjects=list(stream.subjects),
        retention=_RETENTION[stream.retention],
        storage=StorageType.FILE,
        duplicate_window=DEDUP_WINDOW_S,
        max_msg_size=-1,
        max_age=stream.max_age_days * 86400.0 if stream.max_age_days else None,
        max_msgs_per_subject=stream.max_per_subject or -1,
    )


@dataclass
class Delivery:
    """One delivery of a stream message to a consumer handler."""

    msg: Msg
    subject: str
    attempt: int
    stream_seq: int
    msg_id: str | None
    held: bool = False
    _beat: asyncio.Task | None = field(default=None, repr=False)

    def keep_alive(self, *, every_s: float) -> Delivery:
        """Extend the ack deadline every `every_s` seconds from now until the message is acked or naked,
        so that long work (or a message held for later) is not redelivered meanwhile. Used as
        `async with delivery.keep_alive(...)`, the extension also stops when the block ends."""
        self.stop_keep_alive()
        self._beat = asyncio.create_task(self._extend(every_s), name=f"keep-alive-{self.stream_seq}")
        return self

    async def _extend(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.msg.in_progress()
            except Exception as exc:  # a reconnect in progress, or the message is already settled
                log.debug("could not extend an ack deadline", subject=self.subject, error=repr(exc))

    def stop_keep_alive(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None

    async def __aenter__(self) -> Delivery:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop_keep_alive()

    def hold(self) -> None:
        """Keep the message unacknowledged after the handler returns; the owner acks or naks it later."""
        self.held = True

    async def ack(self) -> None:
        self.stop_keep_alive()
        await self.msg.ack()

    async def nak(self) -> None:
        """Hand the message back now, for redelivery."""
        self.stop_keep_alive()
        await self.msg.nak()


Handler = Callable[[Any, Delivery], Awaitable[None]]


class Bus:
    def __init__(
        self,
        nc: NATS,
        *,
        store: ObjectStore | None,
        name: str,
        claim_check_bytes: int,
        refused: dict[str, str] | None = None,
        serve_concurrency: int = DEFAULT_SERVE_CONCURRENCY,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.store = store
        self.name = name
        self.claim_check_bytes = claim_check_bytes
        self.serve_concurrency = serve_concurrency
        """How many requests `serve` handles at once per endpoint, unless told otherwise."""
        self.refused = refused if refused is not None else {}
        """Subjects the server refused this connection (lower-case), with its words (filled by `connect`)."""

    @classmethod
    async def connect(cls, settings: CommonSettings, *, store: ObjectStore | None = None, name: str) -> Bus:
        """Connect as this service's bus identity when `settings.nats_nkey_file` names its seed (see
        `crucible.identities`); its replies arrive under its own inbox prefix, which only it may read."""
        refused: dict[str, str] = {}
        hopeless: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        """Why connecting cannot succeed however often it is tried (set by the first such error)."""
        who = f"the identity in {settings.nats_nkey_file}" if settings.nats_nkey_file else "no identity"

        async def on_error(exc: Exception) -> None:
            text = str(exc)
            if not hopeless.done():
                if (
                    isinstance(exc, nats.errors.AuthorizationError)
                    or "authorization violation" in text.lower()
                ):
                    hopeless.set_result(
                        f"refused {who} (Authorization Violation): a server that admits only bus identities "
                        "needs this service's seed in CRUCIBLE_NATS_NKEY_FILE"
                    )
                elif isinstance(exc, ssl.SSLCertVerificationError):
                    hopeless.set_result(
                        f"has a certificate this service does not trust ({exc.verify_message}): "
                        "CRUCIBLE_NATS_TLS_CA_FILE names the CA that signs it"
                    )
            found = _VIOLATION.search(text)
            if found:  # the server refused a publish or subscription: remembered for the call that made it
                refused[found["subject"].lower()] = text
            log.warning("nats error", error=text)

        options: dict[str, Any] = (
            {"nkeys_seed": str(settings.nats_nkey_file)} if settings.nats_nkey_file else {}
        )
        if settings.nats_tls_ca_file:
            options["tls"] = ssl.create_default_context(cafile=str(settings.nats_tls_ca_file))
        # A few attempts to come up; once connected, reconnect for as long as it takes.
        connecting = asyncio.ensure_future(
            nats.connect(
                settings.nats_url,
                name=f"crucible-{name}",
                connect_timeout=5,
                max_reconnect_attempts=CONNECT_ATTEMPTS,
                reconnect_time_wait=1,
                error_cb=on_error,
                inbox_prefix=access.inbox_prefix(name),
                **options,
            )
        )
        await asyncio.wait({connecting, hopeless}, return_when=asyncio.FIRST_COMPLETED)
        if hopeless.done() and not (connecting.done() and connecting.exception() is None):
            connecting.cancel()
            raise BusError(f"NATS at {settings.nats_url} {hopeless.result()}")
        try:
            nc = connecting.result()
        except Exception as exc:  # nats raises several unrelated types for an unreachable server
            raise BusError(f"cannot connect to NATS at {settings.nats_url}: {exc}") from exc
        nc.options["max_reconnect_attempts"] = -1
        return cls(
            nc, store=store, name=name, claim_check_bytes=settings.claim_check_bytes, refused=refused,
            serve_concurrency=settings.serve_concurrency,
        )  # fmt: skip

    def _failure(self, subject: str, unavailable: BusUnavailable) -> BusError:
        """What a call on `subject` that got no answer means: the server refused this identity the subject
        (`BusRefused`, not an outage to wait out), or it is `unavailable`."""
        reason = self.refused.get(subject.lower())
        if reason is not None:
            return BusRefused(f"the NATS server refused {subject} to this identity ({self.name}): {reason}")
        return unavailable

    async def ensure_streams(self) -> None:
        """Create each stream of `subjects.STREAMS` that is missing, and bring one that differs to this
        version's configuration. Changing a stream is the operator's right alone
        (`crucible.contracts.access`): a service the server refuses it logs the difference and goes on with
        the stream as it is."""
        for stream in subjects.STREAMS.values():
            config = _stream_config(stream)
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                try:
                    await self.js.update_stream(config)
                except (nats.errors.TimeoutError, TimeoutError) as exc:
                    update = f"$JS.API.STREAM.UPDATE.{stream.name}"
                    failure = self._failure(
                        update, BusUnavailable(f"updating stream {stream.name} timed out")
                    )
                    if not isinstance(failure, BusRefused):
                        raise failure from exc
                    log.warning(
                        "stream differs from this version's configuration; "
                        "the operator's identity updates it (crucible up, or crucible bus setup)",
                        stream=stream.name,
                    )

    async def close(self) -> None:
        if self.nc.is_connected:
            try:
                await self.nc.drain()
            except (nats.errors.ConnectionClosedError, nats.errors.FlushTimeoutError):
                pass
        await self.nc.close()

    # --- encoding with claim checks -------------------------------------------------------------

    async def _pack(
        self, subject: str, message: Message, claim_prefix: str | None
    ) -> tuple[bytes, dict[str, str]]:
        data = encode(message)
        if len(data) <= self.claim_check_bytes:
            return data, {}
        if self.store is None:
            raise BusError(
                f"{len(data)} byte message on {subject} needs the object store, and this bus has none"
            )
        # Content-addressed: a republished message never overwrites the bytes an earlier one points at.
        digest = hashlib.sha256(data).hexdigest()
        ref = await self.store.put_bytes(
            f"{claim_prefix or bus_claim_prefix(subject)}/{digest}.msgpack", data
        )
        return msgspec.msgpack.encode(ref), {CLAIM_HEADER: "1"}

    async def _unpack(self, data: bytes, headers: dict[str, str] | None, type_: type[M]) -> M:
        if headers and headers.get(CLAIM_HEADER):
            if self.store is None:
                raise ContractError("claim-checked message, but this bus has no object store")
            try:
                ref = msgspec.msgpack.decode(data, type=ObjectRef)
                data = await self.store.get_bytes(ref)
            except (msgspec.DecodeError, ValueError, IntegrityError, ObjectNotFound) as exc:
                raise ContractError(f"bad claim check: {type(exc).__name__}: {exc}") from exc
        return decode(data, type_)

    # --- streams ----------------------------------------------------------------------------------

    async def publish(
        self, subject: str, message: Message, *, msg_id: str | None = None, claim_prefix: str | None = None
    ) -> bool:
        """Publish to a stream and wait for the server's ack. Returns False if it was a duplicate.

        `claim_prefix` is where the payload goes in the object store if it is too big for a message."""
        data, headers = await self._pack(subject, message, claim_prefix)
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        try:
            ack = await self.js.publish(subject, data, headers=headers or None, timeout=10)
        except (nats.errors.Error, TimeoutError) as exc:
            failed = BusUnavailable(f"publish on {subject} failed: {type(exc).__name__}: {exc}")
            raise self._failure(subject, failed) from exc
        return not ack.duplicate

    async def consume(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler,
        message_type: type[M],
        stop: asyncio.Event,
        ack_wait: float = 30.0,
        max_deliver: int = 5,
        batch: int = 1,
        deliver_new: bool = False,
        max_ack_pending: int = 256,
    ) -> None:
        """Run a durable pull consumer until `stop` is set; in-flight messages finish first.

        The server redelivers without limit; this side dead-letters a message once it has been
        delivered more than `max_deliver` times (or fails on its last attempt), so that nothing is
        ever dropped without a dead letter saying why."""
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=-1,
            filter_subject=filter_subject,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
            max_ack_pending=max(max_ack_pending, batch),
        )
        psub = await self.js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=config)
        # An existing durable keeps the ack wait it was made with: the hold beat follows the server's.
        kept = (await psub.consumer_info()).config.ack_wait or ack_wait
        if abs(kept - ack_wait) > 1e-3:
            log.warning("the durable keeps its own ack wait", consumer=durable, ack_wait=kept, asked=ack_wait)
        beat_s = min(HOLD_BEAT_S, kept / 3)
        try:
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(batch, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except nats.errors.ConnectionClosedError:
                    return
                except nats.errors.Error as exc:  # e.g. the server restarting; the durable survives it
                    log.warning("fetch failed; retrying", stream=stream, consumer=durable, error=repr(exc))
                    await asyncio.sleep(1.0)
                    continue
                for msg in msgs:
                    await self._deliver(
                        msg, stream, durable, handler, message_type, max_deliver, stop, beat_s
                    )
        finally:
            try:
                await psub.unsubscribe()
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                pass

    async def _deliver(
        self,
        msg: Msg,
        stream: str,
        durable: str,
        handler: Handler,
        type_: type[M],
        max_deliver: int,
        stop: asyncio.Event,
        beat_s: float,
    ) -> None:
        meta = msg.metadata
        headers = dict(msg.headers or {})
        delivery = Delivery(
            msg=msg,
            subject=msg.subject,
            attempt=meta.num_delivered,
            stream_seq=meta.sequence.stream,
            msg_id=headers.get("Nats-Msg-Id"),
        )
        try:
            await self._handle(delivery, stream, durable, handler, type_, max_deliver, stop, beat_s)
        finally:
            if not delivery.held:
                delivery.stop_keep_alive()

    async def _handle(
        self,
        delivery: Delivery,
        stream: str,
        durable: str,
        handler: Handler,
        type_: type[M],
        max_deliver: int,
        stop: asyncio.Event,
        beat_s: float,
    ) -> None:
        msg = delivery.msg
        if delivery.attempt > max_deliver:
            reason = f"delivered {delivery.attempt} times without being acknowledged"
            await self.dead_letter(msg, stream=stream, consumer=durable, reason=reason)
            return

        our_beat: asyncio.Task | None = None

        def hold() -> None:  # the work found a dependency away: keep the message while it waits
            nonlocal our_beat
            delivery.held = False
            our_beat = delivery.keep_alive(every_s=beat_s)._beat

        async def work() -> None:
            message = await self._unpack(msg.data, dict(msg.headers or {}), type_)
            await handler(message, delivery)

        try:
            done = await ride_out(work, stop=stop, what=f"consume {stream}", on_hold=hold)
        except asyncio.CancelledError:
            delivery.held = False  # a failed handler's message is settled here, whatever it meant to hold
            await self._settle(msg.nak())
            raise
        except ContractError as exc:  # the message is wrong and will never succeed: park it now
            delivery.held = False
            await self.dead_letter(msg, stream=stream, consumer=durable, reason=str(exc))
            return
        except Exception as exc:  # a handler bug must not stop the consumer
            delivery.held = False
            reason = f"{type(exc).__name__}: {exc}"
            log.warning(
                "handler failed", stream=stream, consumer=durable, attempt=delivery.attempt, error=reason
            )
            if delivery.attempt >= max_deliver:
                await self.dead_letter(msg, stream=stream, consumer=durable, reason=reason)
            else:
                await self._settle(msg.nak(delay=min(30.0, 0.5 * 2 ** (delivery.attempt - 1))))
            return
        if not done:  # stopping while a dependency was away: the next consumer takes it
            delivery.held = False
            await self._settle(msg.nak())
            return
        if not delivery.held:
            await self._settle(msg.ack())
        elif delivery._beat is not None and delivery._beat is our_beat:
            delivery.stop_keep_alive()  # held by the handler now: its owner keeps it alive, or not

    async def _settle(self, reply: Awaitable[None]) -> None:
        """Ack or nak; if that fails (a reconnect), the server redelivers after the ack wait."""
        try:
            await reply
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not settle a message; it will be redelivered", error=repr(exc))

    async def dead_letter(self, msg: Msg, *, stream: str, consumer: str, reason: str) -> None:
        """Park a message that cannot be processed, with the reason, and stop its redelivery."""
        letter = DeadLetter(
            stream=stream,
            subject=msg.subject,
            consumer=consumer,
            reason=reason,
            deliveries=msg.metadata.num_delivered,
            payload=msg.data,
            headers={k: v for k, v in (msg.headers or {}).items()},
        )
        log.error("dead-lettered", stream=stream, consumer=consumer, subject=msg.subject, reason=reason)
        # One dead letter per stream message and consumer: a consumer that dies between parking a message
        # and terminating it parks it again when it comes back, and JetStream drops the duplicate.
        once = {"Nats-Msg-Id": f"deadletter/{stream}/{consumer}/{msg.metadata.sequence.stream}"}
        try:
            await self.js.publish(subjects.dead_letter(stream), encode(letter), headers=once)
        except (nats.errors.Error, TimeoutError) as exc:
            log.error("could not dead-letter; leaving it for redelivery", error=repr(exc))
            return
        await self._settle(msg.term())

    async def dead_letters(
        self, *, stream: str | None = None, limit: int = 50
    ) -> list[tuple[int, DeadLetter]]:
        """The newest dead letters (of `stream`'s consumers, or of every stream), newest first, each with
        its sequence number on the dead-letter stream."""
        state = (await self.js.stream_info(subjects.DEAD_LETTER)).state
        wanted = subjects.dead_letter(stream) if stream else None
        found: list[tuple[int, DeadLetter]] = []
        seq = state.last_seq
        while seq >= max(state.first_seq, 1) and len(found) < limit:
            try:
                raw = await self.js.get_msg(subjects.DEAD_LETTER, seq)
            except nats.js.errors.NotFoundError:  # replayed, or dropped by the stream's limits
                seq -= 1
                continue
            if wanted is None or raw.subject == wanted:
                found.append((seq, decode(raw.data or b"", DeadLetter)))
            seq -= 1
        return found

    async def dead_letter_at(self, seq: int) -> DeadLetter:
        """Dead letter `seq`; LookupError if there is none (never written, or replayed already)."""
        try:
            raw = await self.js.get_msg(subjects.DEAD_LETTER, seq)
        except nats.js.errors.NotFoundError:
            raise LookupError(f"no dead letter {seq} (never written, or replayed already)") from None
        return decode(raw.data or b"", DeadLetter)

    async def replay_dead_letter(self, seq: int) -> DeadLetter:
        """Publish dead letter `seq`'s message again, as it was, on its subject (its consumer gets it
        anew), then remove the letter. Its message id gets a suffix: the first is still remembered."""
        letter = await self.dead_letter_at(seq)
        headers = dict(letter.headers)
        headers["Nats-Msg-Id"] = f"{headers.get('Nats-Msg-Id') or letter.subject}/replay-{seq}"
        await self.js.publish(letter.subject, letter.payload, headers=headers)
        await self.js.delete_msg(subjects.DEAD_LETTER, seq)
        return letter

    async def latest(self, stream: str, subject: str, type_: type[M]) -> M | None:
        """The newest message on a subject, or None."""
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            failed = BusUnavailable(
                f"reading the newest message on {subject} failed: {type(exc).__name__}: {exc}"
            )
            raise self._failure(f"$JS.API.STREAM.MSG.GET.{stream}", failed) from exc
        return await self._unpack(raw.data or b"", dict(raw.headers or {}), type_)

    async def watch(
        self,
        subject: str,
        type_: type[M],
        callback: Callable[[M], Awaitable[None]],
        *,
        last_per_subject: bool = False,
    ) -> Any:
        """Follow a stream subject with an ordered, ephemeral consumer: new messages only, or first the
        newest message of every matching subject and then new ones."""

        async def on_msg(msg: Msg) -> None:
            try:
                message = await self._unpack(msg.data, dict(msg.headers or {}), type_)
            except ContractError as exc:
                log.error("undecodable message on watched subject", subject=msg.subject, error=str(exc))
                return
            await callback(message)

        policy = DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else DeliverPolicy.NEW
        return await self.js.subscribe(subject, cb=on_msg, ordered_consumer=True, deliver_policy=policy)

    # --- request / reply --------------------------------------------------------------------------

    async def request(self, endpoint: Endpoint[M, R], message: M, *, timeout: float = 5.0) -> R:
        """Ask the service on `endpoint`. "No responders" is retried for up to NO_RESPONDERS_GRACE_S (within
        `timeout`): nats-server can answer it for a moment after a service's subscription is confirmed
        (about 1 in 100 requests sent right after, in our tests), and a restarting service comes back;
        a subject nobody serves still fails fast."""
        subject, reply_type = endpoint.subject, endpoint.reply
        data, headers = await self._pack(subject, message, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        give_up = loop.time() + min(timeout, NO_RESPONDERS_GRACE_S)
        pause = 0.005
        while True:
            try:
                reply = await self.nc.request(
                    subject, data, timeout=max(deadline - loop.time(), 0.001), headers=headers or None
                )
                break
            except nats.errors.NoRespondersError as exc:
                if loop.time() + pause > give_up:
                    raise BusTimeout(f"no service answers {subject}") from exc
                await asyncio.sleep(pause)
                pause *= 2
            except nats.errors.TimeoutError as exc:
                raise self._failure(
                    subject, BusTimeout(f"no reply on {subject} within {timeout:.1f}s")
                ) from exc
        reply_headers = dict(reply.headers or {})
        if reply_headers.get(ERROR_HEADER):
            err = msgspec.msgpack.decode(reply.data, type=_ErrorReply)
            raise (RemoteUnavailable if err.code in TRANSIENT_CODES else RemoteError)(err.code, err.detail)
        return await self._unpack(reply.data, reply_headers, reply_type)

    async def serve(
        self,
        endpoint: Endpoint[M, R],
        handler: Callable[[M], Awaitable[R]],
        *,
        concurrency: int | None = None,
    ) -> Any:
        """Answer requests on `endpoint` (in its queue group), each as its own task, counted and timed. At
        most `concurrency` (default `serve_concurrency`) run at once; the others wait for a free slot (their
        requesters' deadlines still run)."""
        subject, request_type = endpoint.subject, endpoint.request
        tasks: set[asyncio.Task] = set()
        latency = REQUEST_SECONDS.labels(subject)
        in_flight, waiting = IN_FLIGHT.labels(subject), WAITING.labels(subject)
        slots = asyncio.Semaphore(concurrency or self.serve_concurrency)

        async def bounded(msg: Msg) -> None:
            waiting.inc()
            try:
                await slots.acquire()
            finally:
                waiting.dec()
            try:
                with in_flight.track_inprogress():
                    await answer(msg)
            finally:
                slots.release()

        async def answer(msg: Msg) -> None:
            started = time.perf_counter()
            result = "ok"
            try:
                request = await self._unpack(msg.data, dict(msg.headers or {}), request_type)
                reply = await handler(request)
                data, headers = await self._pack(msg.reply, reply, None)
            except (RequestError, ContractError, Unavailable) as exc:
                if isinstance(exc, RequestError):
                    result, detail = exc.code, exc.detail
                else:
                    result, detail = (
                        ("bad_request" if isinstance(exc, ContractError) else "unavailable"),
                        str(exc),
                    )
                data, headers = msgspec.msgpack.encode(_ErrorReply(result, detail)), {ERROR_HEADER: "1"}
            except Exception as exc:  # never let one request take the service down
                log.exception("request handler failed", subject=subject)
                result = "internal"
                data = msgspec.msgpack.encode(_ErrorReply(result, f"{type(exc).__name__}: {exc}"))
                headers = {ERROR_HEADER: "1"}
            latency.observe(time.perf_counter() - started)
            REQUESTS.labels(subject, result).inc()
            if msg.reply:
                try:
                    await self.nc.publish(msg.reply, data, headers=headers or None)
                except nats.errors.ConnectionClosedError:
                    pass

        async def on_msg(msg: Msg) -> None:
            task = asyncio.create_task(bounded(msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        sub = await self.nc.subscribe(subject, queue=endpoint.queue, cb=on_msg)
        # The server must know the subscription before the caller announces itself ready; otherwise a
        # request sent right after "ready" can race the SUB and get "no responders".
        try:
            await self.nc.flush()
        except nats.errors.TimeoutError as exc:
            # Reconnecting: the client re-subscribes once it is back.
            log.warning("subscription not confirmed by the server yet", subject=subject, error=repr(exc))
        if subject.lower() in self.refused:  # a refusal that arrived by now; a later one is only logged
            await sub.unsubscribe()
            raise BusRefused(f"the NATS server refused this identity ({self.name}) to serve {subject}")
        return sub
