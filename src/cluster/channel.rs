//! The framed TCP channel between node 0 and another node: each frame is its payload's
//! length (u32, little-endian), a tag byte, then the payload. Collectives' values travel as
//! little-endian f32s, everything else as JSON.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// Another node's greeting: its version, rank and [`super::GroupSetup`].
    Hello = 1,
    /// Node 0's answer: accepted, with what the group shares ([`super::lead::Welcome`]) ...
    Welcome = 2,
    /// ... or refused, with the reason.
    Refuse = 3,
    /// A step's inputs (node 0 → node).
    Step = 4,
    /// A rank's part of a collective (node → node 0).
    Part = 5,
    /// A collective's result (node 0 → node).
    Result = 6,
    /// The step is done: `null`, or the node's error as a JSON string (node → node 0).
    Done = 7,
    /// A command outside the steps ([`super::NodeCommand`], node 0 → node).
    Command = 8,
    /// A command's answer ([`super::NodeAnswer`], node → node 0); a node whose command
    /// failed answers [`Tag::Done`] with its error instead.
    Answer = 9,
}

impl Tag {
    fn from_u8(b: u8) -> Option<Tag> {
        [
            Tag::Hello,
            Tag::Welcome,
            Tag::Refuse,
            Tag::Step,
            Tag::Part,
            Tag::Result,
            Tag::Done,
            Tag::Command,
            Tag::Answer,
        ]
        .into_iter()
        .find(|t| *t as u8 == b)
    }
}

/// The largest frame taken: a step of 64 Ki tokens' inputs, or a collective over a
/// vocabulary-wide batch, fits many times over.
const MAX_FRAME: usize = 1 << 30;

/// One end of a connection between node 0 and another node.
pub struct Channel {
    stream: TcpStream,
    /// Who is at the other end, for errors: `node N (ADDR)`.
    peer: String,
}

impl Channel {
    pub fn new(stream: TcpStream, peer: String) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        Ok(Self { stream, peer })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn set_peer(&mut self, peer: String) {
        self.peer = peer;
    }

    /// A frame's header for `len` payload bytes, with room for them.
    fn frame(tag: Tag, len: usize) -> Vec<u8> {
        let mut frame = Vec::with_capacity(5 + len);
        frame.extend_from_slice(&(len as u32).to_le_bytes());
        frame.push(tag as u8);
        frame
    }

    fn write(&mut self, frame: &[u8]) -> Result<(), String> {
        self.stream.write_all(frame).map_err(|e| format!("{}: the connection failed: {e}", self.peer))
    }

    pub fn send(&mut self, tag: Tag, payload: &[u8]) -> Result<(), String> {
        let mut frame = Self::frame(tag, payload.len());
        frame.extend_from_slice(payload);
        self.write(&frame)
    }

    pub fn send_f32(&mut self, tag: Tag, values: &[f32]) -> Result<(), String> {
        let mut frame = Self::frame(tag, 4 * values.len());
        frame.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.write(&frame)
    }

    /// The next frame, waiting at most `timeout` (None: as long as it takes).
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<(Tag, Vec<u8>), String> {
        self.stream.set_read_timeout(timeout).map_err(|e| format!("{}: {e}", self.peer))?;
        let mut head = [0u8; 5];
        self.read(&mut head, timeout)?;
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let tag = Tag::from_u8(head[4])
            .ok_or_else(|| format!("{}: a frame of unknown kind {}", self.peer, head[4]))?;
        if len > MAX_FRAME {
            return Err(format!("{}: a frame of {len} bytes is more than {MAX_FRAME}", self.peer));
        }
        let mut payload = vec![0u8; len];
        self.read(&mut payload, timeout)?;
        Ok((tag, payload))
    }

    /// The next frame, which must be a `want`; a [`Tag::Done`] carrying an error in its
    /// place is that node's error.
    pub fn expect(&mut self, want: Tag, timeout: Option<Duration>) -> Result<Vec<u8>, String> {
        match self.recv(timeout)? {
            (tag, payload) if tag == want => Ok(payload),
            (Tag::Done, payload) => match serde_json::from_slice::<Option<String>>(&payload) {
                Ok(Some(e)) => Err(format!("{} failed: {e}", self.peer)),
                _ => Err(format!("{}: ended its step where {want:?} was due", self.peer)),
            },
            (Tag::Refuse, payload) => {
                Err(format!("{} refused: {}", self.peer, String::from_utf8_lossy(&payload)))
            }
            (tag, _) => Err(format!("{}: sent {tag:?} where {want:?} was due", self.peer)),
        }
    }

    pub fn expect_f32(&mut self, want: Tag, timeout: Option<Duration>) -> Result<Vec<f32>, String> {
        let bytes = self.expect(want, timeout)?;
        if !bytes.len().is_multiple_of(4) {
            return Err(format!("{}: {} bytes are not f32 values", self.peer, bytes.len()));
        }
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect())
    }

    fn read(&mut self, buf: &mut [u8], timeout: Option<Duration>) -> Result<(), String> {
        self.stream.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => format!("{} closed the connection", self.peer),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "{} did not answer within {:.1} s",
                self.peer,
                timeout.unwrap_or_default().as_secs_f64()
            ),
            _ => format!("{}: the connection failed: {e}", self.peer),
        })
    }

    /// Closes both directions: the other end's reads end at once.
    pub fn close(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// The connection's socket again, for a thread that watches it or closes it while
    /// another waits on it.
    pub fn socket(&self) -> std::io::Result<TcpStream> {
        self.stream.try_clone()
    }
}

/// Whether the other end has closed `socket` (or it has failed), looking without waiting
/// and without taking any bytes: frames that arrived stay for their reader. The socket's
/// own settings (blocking, timeouts) are shared with that reader and are left alone.
pub fn closed(socket: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: reads at most one byte into `byte`, which outlives the call.
    let n = unsafe {
        libc::recv(socket.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    match n {
        0 => true,
        n if n > 0 => false,
        _ => {
            let e = std::io::Error::last_os_error().kind();
            !matches!(e, std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Channel, Channel) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (Channel::new(a, "node 0".into()).unwrap(), Channel::new(b, "node 1".into()).unwrap())
    }

    #[test]
    fn a_closed_end_is_seen_without_taking_the_bytes_that_wait() {
        let (a, mut b) = pair();
        let watched = b.socket().unwrap();
        assert!(!closed(&watched), "an idle open connection");
        let mut a = a;
        a.send(Tag::Step, b"[1]").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!closed(&watched), "a connection with a frame waiting");
        a.close();
        drop(a);
        std::thread::sleep(Duration::from_millis(50));
        // The frame sent before the close is still there for the reader.
        assert_eq!(b.recv(Some(Duration::from_secs(1))).unwrap(), (Tag::Step, b"[1]".to_vec()));
        assert!(closed(&watched));
    }

    #[test]
    fn frames_arrive_whole_and_in_order() {
        let (mut a, mut b) = pair();
        a.send(Tag::Step, b"{\"ids\":[1]}").unwrap();
        a.send_f32(Tag::Part, &[1.5, -2.0, f32::MIN_POSITIVE]).unwrap();
        assert_eq!(b.recv(None).unwrap(), (Tag::Step, b"{\"ids\":[1]}".to_vec()));
        assert_eq!(b.expect_f32(Tag::Part, None).unwrap(), vec![1.5, -2.0, f32::MIN_POSITIVE]);
        // A node's error in place of the frame due is that node's error.
        a.send(Tag::Done, b"\"out of memory\"").unwrap();
        let e = b.expect(Tag::Part, None).unwrap_err();
        assert!(e.contains("node 1 failed: out of memory"), "{e}");
    }

    #[test]
    fn silence_and_a_closed_end_are_errors_that_name_the_node() {
        let (a, mut b) = pair();
        let e = b.recv(Some(Duration::from_millis(50))).unwrap_err();
        assert!(e.contains("node 1 did not answer within 0.1 s"), "{e}");
        a.close();
        drop(a);
        let e = b.recv(Some(Duration::from_secs(5))).unwrap_err();
        assert!(e.contains("node 1 closed the connection"), "{e}");
    }

    #[test]
    fn a_frame_of_unknown_kind_or_size_is_refused() {
        let (mut a, mut b) = pair();
        a.stream.write_all(&[0, 0, 0, 0, 99]).unwrap();
        assert!(b.recv(None).unwrap_err().contains("unknown kind 99"));
        a.stream.write_all(&(u32::MAX).to_le_bytes()).unwrap();
        a.stream.write_all(&[Tag::Part as u8]).unwrap();
        assert!(b.recv(None).unwrap_err().contains("more than"));
    }
}
