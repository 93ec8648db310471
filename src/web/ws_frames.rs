//! The WebSocket's bytes checked as they arrive, before the frame decoder buffers them: each
//! frame header is validated (masked, no reserved bits, a known opcode, control frames
//! short and final, a size within the limit) as soon as it is complete, so a header that
//! announces 2⁴⁰ bytes is refused before one byte of its payload is read; a fragmented
//! message is held to the same limit by its announced sizes; and the bytes read but not yet
//! handled by the session are capped, so a client that floods a socket waits on TCP instead
//! of filling the server's memory. The first violation ends the input; the session then
//! closes with the code [`FrameGuard`] recorded.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use actix_web::error::PayloadError;
use actix_web::web::Bytes;
use actix_web_actors::ws::CloseCode;
use futures::Stream;

/// Why the input was cut: the close code and its reason.
pub type Violation = (CloseCode, String);

/// What the session and the guard share: the sizes of frames read but not yet handled, the
/// guard's waker while it waits for room, and the violation that ended the input.
#[derive(Default)]
pub struct Ledger {
    queued: RefCell<VecDeque<usize>>,
    queued_bytes: Cell<usize>,
    waiting: RefCell<Option<Waker>>,
    violation: RefCell<Option<Violation>>,
}

impl Ledger {
    /// The session handled one frame: room for more input.
    pub fn handled(&self) {
        if let Some(n) = self.queued.borrow_mut().pop_front() {
            self.queued_bytes.set(self.queued_bytes.get() - n);
        }
        if let Some(w) = self.waiting.borrow_mut().take() {
            w.wake();
        }
    }

    /// The violation that cut the input, if one did.
    pub fn violation(&self) -> Option<Violation> {
        self.violation.borrow().clone()
    }
}

enum Reading {
    /// Header bytes gathered so far (at most 14: 2 + 8 length + 4 mask).
    Header(Vec<u8>),
    /// Payload bytes of the current frame still to come.
    Payload(u64),
}

/// Validates the frames of `inner` (the upgraded connection's bytes) as they pass.
pub struct FrameGuard<S> {
    inner: S,
    ledger: Rc<Ledger>,
    reading: Reading,
    /// Bytes of the frame in progress (header and payload), counted when it completes.
    frame_bytes: usize,
    /// Announced size of the fragmented message in progress, if one is.
    fragmented: Option<u64>,
    max_frame: usize,
    max_buffered: usize,
    done: bool,
}

impl<S> FrameGuard<S> {
    /// Frames (and fragmented messages) up to `max_frame` payload bytes; up to
    /// `max_buffered` bytes read ahead of the session.
    pub fn new(inner: S, max_frame: usize, max_buffered: usize) -> (Self, Rc<Ledger>) {
        let ledger = Rc::new(Ledger::default());
        let guard = Self {
            inner,
            ledger: ledger.clone(),
            reading: Reading::Header(Vec::with_capacity(14)),
            frame_bytes: 0,
            fragmented: None,
            max_frame,
            max_buffered,
            done: false,
        };
        (guard, ledger)
    }

    /// Checks a complete header: `Ok(Some(payload length))`, `Ok(None)` when more header
    /// bytes are needed, `Err` for a violation.
    fn header(&mut self, h: &[u8]) -> Result<Option<u64>, Violation> {
        if h.len() < 2 {
            return Ok(None);
        }
        let (fin, rsv, opcode) = (h[0] & 0x80 != 0, h[0] & 0x70, h[0] & 0x0F);
        let (masked, len7) = (h[1] & 0x80 != 0, h[1] & 0x7F);
        let need =
            2 + match len7 {
                126 => 2,
                127 => 8,
                _ => 0,
            } + 4;
        let protocol = |m: String| Err((CloseCode::Protocol, m));
        if rsv != 0 {
            return protocol("reserved bits set without a negotiated extension".into());
        }
        if !masked {
            return protocol("client frames must be masked".into());
        }
        let control = opcode >= 8;
        if !matches!(opcode, 0 | 1 | 2 | 8 | 9 | 10) {
            return protocol(format!("unknown opcode {opcode}"));
        }
        if control && (!fin || len7 > 125) {
            return protocol("control frames must be final and at most 125 bytes".into());
        }
        if h.len() < need {
            return Ok(None);
        }
        let len = match len7 {
            126 => u64::from(u16::from_be_bytes([h[2], h[3]])),
            127 => u64::from_be_bytes(h[2..10].try_into().expect("8 bytes")),
            n => u64::from(n),
        };
        let too_big = |what: &str, n: u64| {
            Err((
                CloseCode::Size,
                format!("{what} of {n} bytes is over the limit of {} bytes", self.max_frame),
            ))
        };
        if len > self.max_frame as u64 {
            return too_big("a frame", len);
        }
        if !control {
            match (opcode, self.fragmented) {
                (0, None) => return protocol("a continuation frame without a message to continue".into()),
                (1 | 2, Some(_)) => return protocol("a new message inside a fragmented one".into()),
                _ => {}
            }
            let total = self.fragmented.unwrap_or(0) + len;
            if total > self.max_frame as u64 {
                return too_big("a fragmented message", total);
            }
            self.fragmented = (!fin).then_some(total);
        }
        Ok(Some(len))
    }

    /// Passes `chunk` through the frame reader and returns the bytes to hand on: payload
    /// as it comes, a header only once it is complete and valid. A violation is recorded and
    /// ends the input; what came before it is still handed on.
    fn scan(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len());
        let mut i = 0;
        while i < chunk.len() {
            match &mut self.reading {
                Reading::Payload(left) => {
                    let take = (*left).min((chunk.len() - i) as u64) as usize;
                    *left -= take as u64;
                    out.extend_from_slice(&chunk[i..i + take]);
                    i += take;
                    self.frame_bytes += take;
                    if *left == 0 {
                        self.frame_done();
                    }
                }
                Reading::Header(h) => {
                    h.push(chunk[i]);
                    i += 1;
                    let h = std::mem::take(h);
                    match self.header(&h) {
                        Ok(None) => self.reading = Reading::Header(h),
                        Ok(Some(len)) => {
                            out.extend_from_slice(&h);
                            self.frame_bytes += h.len();
                            if len == 0 {
                                self.frame_done();
                            } else {
                                self.reading = Reading::Payload(len);
                            }
                        }
                        Err(v) => {
                            *self.ledger.violation.borrow_mut() = Some(v);
                            self.done = true;
                            return out;
                        }
                    }
                }
            }
        }
        out
    }

    fn frame_done(&mut self) {
        let n = std::mem::take(&mut self.frame_bytes);
        self.ledger.queued.borrow_mut().push_back(n);
        self.ledger.queued_bytes.set(self.ledger.queued_bytes.get() + n);
        self.reading = Reading::Header(Vec::with_capacity(14));
    }
}

impl<S> Stream for FrameGuard<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.ledger.queued_bytes.get() + self.frame_bytes >= self.max_buffered {
            *self.ledger.waiting.borrow_mut() = Some(cx.waker().clone());
            return Poll::Pending;
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let out = self.scan(&chunk);
                match out.is_empty() {
                    true if self.done => Poll::Ready(None),
                    _ => Poll::Ready(Some(Ok(Bytes::from(out)))),
                }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    /// A masked frame's header for `opcode` and payload length `len`.
    fn header(fin: bool, opcode: u8, len: u64) -> Vec<u8> {
        let mut h = vec![(u8::from(fin) << 7) | opcode];
        match len {
            0..=125 => h.push(0x80 | len as u8),
            126..=65535 => {
                h.push(0x80 | 126);
                h.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                h.push(0x80 | 127);
                h.extend_from_slice(&len.to_be_bytes());
            }
        }
        h.extend_from_slice(&[1, 2, 3, 4]);
        h
    }

    fn run(bytes: Vec<u8>, split: usize) -> (Vec<u8>, Option<Violation>) {
        let chunks: Vec<Result<Bytes, PayloadError>> =
            bytes.chunks(split).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let (guard, ledger) = FrameGuard::new(futures::stream::iter(chunks), 1000, 1 << 20);
        let out: Vec<_> = futures::executor::block_on(guard.collect::<Vec<_>>());
        (out.into_iter().flat_map(|c| c.unwrap().to_vec()).collect(), ledger.violation())
    }

    #[test]
    fn good_frames_pass_and_the_first_bad_header_cuts_the_input_before_it() {
        let mut ok = header(true, 1, 3);
        ok.extend_from_slice(b"abc");
        ok.extend(header(false, 1, 2));
        ok.extend_from_slice(b"de");
        ok.extend(header(true, 9, 0)); // a ping between fragments
        ok.extend(header(true, 0, 1));
        ok.push(b'f');
        for split in [1, 3, 64] {
            assert_eq!(run(ok.clone(), split), (ok.clone(), None), "chunks of {split}");
            let cases: [(Vec<u8>, CloseCode); 7] = [
                (header(true, 1, 1 << 40), CloseCode::Size),
                (vec![0x81, 0x03, b'a', b'b', b'c'], CloseCode::Protocol), // unmasked
                (header(true, 0x41, 1), CloseCode::Protocol),              // RSV3
                (header(true, 3, 1), CloseCode::Protocol),                 // opcode 3
                (header(false, 9, 1), CloseCode::Protocol),                // fragmented ping
                (header(true, 0, 1), CloseCode::Protocol),                 // nothing to continue
                ([header(false, 1, 600), vec![0; 600], header(true, 0, 600)].concat(), CloseCode::Size),
            ];
            for (bad, code) in cases {
                let bytes = [ok.clone(), bad.clone(), vec![0; 32]].concat();
                let (passed, v) = run(bytes, split);
                // The fragmented case's first frame (a header of 8 bytes) is valid.
                let want = if bad.len() > 600 { ok.len() + 8 + 600 } else { ok.len() };
                assert_eq!(passed.len(), want, "{bad:?} in chunks of {split}");
                assert_eq!(v.map(|v| v.0), Some(code), "{bad:?}");
            }
        }
    }
}
