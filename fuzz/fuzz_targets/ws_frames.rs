//! WebSocket bytes through the server's frame guard and actix's decoder, as a session reads
//! them: chunked at the first byte's size, with the session handling each decoded frame.
//! The guard never hands on more than it read, never waits for room that handling cannot
//! free, and without a violation holds back nothing but an unfinished last header.
#![no_main]

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_http::ws::Codec;
use actix_web::error::PayloadError;
use actix_web::web::{Bytes, BytesMut};
use actorllm::web::ws_frames::FrameGuard;
use futures::Stream;
use tokio_util::codec::Decoder;

const MAX_FRAME: usize = 1 << 10;
const MAX_BUFFERED: usize = 4 << 10;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else { return };
    let chunks: Vec<Result<Bytes, PayloadError>> =
        bytes.chunks(usize::from(split).max(1)).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    let (mut guard, ledger) = FrameGuard::new(futures::stream::iter(chunks), MAX_FRAME, MAX_BUFFERED);
    let mut codec = Codec::new().max_size(MAX_FRAME + 1);
    let mut buf = BytesMut::new();
    let mut passed = 0;
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    loop {
        let (progressed, done) = match Pin::new(&mut guard).poll_next(&mut cx) {
            Poll::Ready(Some(Ok(b))) => {
                passed += b.len();
                buf.extend_from_slice(&b);
                (true, false)
            }
            Poll::Ready(Some(Err(_))) => unreachable!("the input stream has no errors"),
            Poll::Ready(None) => (true, true),
            Poll::Pending => (false, false),
        };
        let mut handled = 0;
        while let Ok(Some(_)) = codec.decode(&mut buf) {
            ledger.handled();
            handled += 1;
        }
        if done {
            break;
        }
        assert!(progressed || handled > 0, "the guard waits for room that no decodable frame can free");
    }
    assert!(passed <= bytes.len());
    if ledger.violation().is_none() {
        // Only an unfinished header at the end of the input may be held back.
        assert!(bytes.len() - passed < 14, "{} bytes held back without a violation", bytes.len() - passed);
    }
});
