//! Firecracker's handshake: one message on the Unix socket carrying the userfaultfd
//! (`SCM_RIGHTS`) and the JSON array of regions, read and checked (see the parent module).

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use linux_raw_sys::general as uapi;

use super::peer::PeerProcess;
use super::regions::{parse_regions, UffdRegion};
use super::ServeError;
use crate::layout::MAX_REGIONS;
use crate::uffd::Uffd;

/// The largest handshake message read (a JSON object per region).
pub const MAX_HANDSHAKE_BYTES: usize = 4 << 20;
/// Why a peer's handshake was refused: what Firecracker sends is one message with one
/// userfaultfd and a JSON array of regions; each variant is one way a peer's was not that.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Nobody connected in time ([`Handshake::accept`]).
    #[error("no peer connected within {:.1} s", .0.as_secs_f64())]
    NoPeer(Duration),
    /// No connection completed a VM's handshake in time (the server's accept timeout).
    #[error("no VM connected within {:.1} s", .0.as_secs_f64())]
    NoVm(Duration),
    /// The peer connected and sent nothing within the handshake timeout.
    #[error("nothing received within {:.1} s", .0.as_secs_f64())]
    Silent(Duration),
    /// The peer closed the connection without sending anything.
    #[error("the peer disconnected before sending anything")]
    Empty,
    /// The message carried no descriptor.
    #[error(
        "no file descriptor came with the message (Firecracker sends its userfaultfd with \
         SCM_RIGHTS)"
    )]
    NoDescriptor,
    /// The message carried more than one descriptor (`count`; `None`: more than the control
    /// buffer holds).
    #[error("{} file descriptors came with the message; Firecracker sends one",
        .0.map_or(format!("more than {MAX_FDS}"), |k| k.to_string()))]
    Descriptors(Option<usize>),
    /// The descriptor is not a userfaultfd this process can use.
    #[error("the descriptor sent is not usable: {0}")]
    NotUserfaultfd(#[source] io::Error),
    /// The userfaultfd asks for events a page server cannot follow.
    #[error(
        "the peer's userfaultfd has {0} enabled; guestmem's page server does not follow forks, \
         remaps or unmaps (Firecracker enables none of them)"
    )]
    UnfollowedEvent(&'static str),
    /// The JSON did not come whole within the handshake timeout.
    #[error("the JSON stopped after {bytes} bytes: the handshake was not whole within {:.1} s",
        .timeout.as_secs_f64())]
    CutOff {
        /// Bytes of JSON received.
        bytes: usize,
        /// The handshake timeout.
        timeout: Duration,
    },
    /// The peer closed the connection before the JSON was whole.
    #[error("the peer disconnected mid-handshake, after {0} bytes of JSON")]
    Disconnected(usize),
    /// The message is longer than [`MAX_HANDSHAKE_BYTES`].
    #[error("message longer than {MAX_HANDSHAKE_BYTES} bytes")]
    TooLong,
    /// The text is not a JSON array of regions.
    #[error("not Firecracker's JSON array of regions ({reason}; {bytes} bytes received)")]
    NotRegions {
        /// What the JSON parser said.
        reason: String,
        /// Bytes received.
        bytes: usize,
    },
    /// The array is empty.
    #[error("no regions")]
    NoRegions,
    /// More regions than KVM has memory slots.
    #[error("{0} regions; at most {MAX_REGIONS} (KVM's memory slots)")]
    TooManyRegions(usize),
    /// One region's field is wrong.
    #[error("region {index} (host {host:#x}): {reason}")]
    Region {
        /// The region's index in the array.
        index: usize,
        /// Its `base_host_virt_addr`.
        host: u64,
        /// The JSON field at fault: `base_host_virt_addr`, `size`, `offset`, `page_size` or
        /// `page_size_kib`.
        field: &'static str,
        /// What is wrong with it, naming the field and its value.
        reason: String,
    },
    /// Two regions overlap.
    #[error(
        "regions {a} and {b} overlap in the {space} ({a_start:#x}+{a_size:#x} and \
             {b_start:#x}+{b_size:#x})"
    )]
    Overlap {
        /// The lower region's index.
        a: usize,
        /// The higher region's index.
        b: usize,
        /// `peer's address space` or `memory file`.
        space: &'static str,
        /// Where the lower one starts there.
        a_start: u64,
        /// Its size.
        a_size: u64,
        /// Where the higher one starts there.
        b_start: u64,
        /// Its size.
        b_size: u64,
    },
    /// A VM connected to a one-VM server that has its VM already (or gave up waiting).
    #[error("a VM connected to a server that serves one VM and has it (or gave up)")]
    Late,
    /// A VM's handshake completed after a draining fleet stopped waiting for it.
    #[error("a VM's handshake completed after the server had begun to drain")]
    Draining,
}

impl HandshakeError {
    /// The JSON field at fault, for a region refused over one field.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            HandshakeError::Region { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// A peer's handshake, received and checked: its userfaultfd and regions, and the socket it
/// keeps open while it runs.
#[derive(Debug)]
pub struct Handshake {
    pub(super) regions: Vec<UffdRegion>,
    pub(super) uffd: Uffd,
    pub(super) peer: UnixStream,
    pub(super) process: PeerProcess,
}

/// A handshake refused; `process` is the peer when it had sent a userfaultfd (it depends on
/// a server now: Firecracker keeps its own reference and would wait on its faults for ever),
/// `None` when it had not (a squatter, a probe: dropping it hurts nobody).
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) error: ServeError,
    pub(crate) process: Option<PeerProcess>,
}

/// userfaultfd events a page server cannot follow: a fork hands it a new descriptor per
/// child, a remap moves registered memory, an unmap takes it away. Firecracker asks for
/// none of them (only `UFFD_EVENT_REMOVE`, with a balloon).
const UNFOLLOWED_EVENTS: [(u32, &str); 3] = [
    (uapi::UFFD_FEATURE_EVENT_FORK, "UFFD_FEATURE_EVENT_FORK"),
    (uapi::UFFD_FEATURE_EVENT_REMAP, "UFFD_FEATURE_EVENT_REMAP"),
    (uapi::UFFD_FEATURE_EVENT_UNMAP, "UFFD_FEATURE_EVENT_UNMAP"),
];

impl Handshake {
    /// Waits up to `wait` for a peer to connect to `listener`, then gives it `timeout` to
    /// send its handshake (see [`Handshake::receive`]).
    pub fn accept(
        listener: &UnixListener,
        wait: Duration,
        timeout: Duration,
    ) -> Result<Handshake, ServeError> {
        use std::os::fd::AsFd;
        let mut fds = [crate::sys::PollFd::readable(listener.as_fd())];
        let n = crate::sys::poll(&mut fds, Some(wait))
            .map_err(ServeError::io("wait for the peer to connect"))?;
        if n == 0 {
            return Err(HandshakeError::NoPeer(wait).into());
        }
        let (stream, _) = listener.accept().map_err(ServeError::io("accept"))?;
        Handshake::receive(stream, timeout)
    }

    /// Reads the handshake from `stream`: one message with one descriptor and the regions'
    /// JSON, taking at most `timeout`. Refuses a peer that sends garbage, no descriptor (or
    /// more than one, or one that is not a userfaultfd), regions that do not hold together,
    /// or that disconnects before the JSON is whole.
    pub fn receive(stream: UnixStream, timeout: Duration) -> Result<Handshake, ServeError> {
        receive_checked(stream, timeout).map_err(|r| r.error)
    }
}

/// [`Handshake::receive`], saying of a refusal whether the peer had sent a userfaultfd.
pub(crate) fn receive_checked(stream: UnixStream, timeout: Duration) -> Result<Handshake, Refused> {
    // The peer as it connected: a pidfd now, before its pid could be reused.
    let process = PeerProcess::of(&stream);
    let mut got_uffd = false;
    let refuse = |error: ServeError, got_uffd: bool, process: PeerProcess| Refused {
        error,
        process: got_uffd.then_some(process),
    };
    match receive_inner(&stream, timeout, &mut got_uffd) {
        Ok((regions, uffd)) => Ok(Handshake {
            regions,
            uffd,
            peer: stream,
            process,
        }),
        Err(e) => Err(refuse(e, got_uffd, process)),
    }
}

/// Reads and checks the message; sets `got_uffd` once a descriptor that is a userfaultfd
/// has come (from then on, a refusal leaves a VM without a server).
fn receive_inner(
    stream: &UnixStream,
    timeout: Duration,
    got_uffd: &mut bool,
) -> Result<(Vec<UffdRegion>, Uffd), ServeError> {
    let mut r = Reader {
        stream,
        deadline: Instant::now() + timeout,
        timeout,
        buf: vec![0u8; 64 << 10],
    };
    let (n, fd) = r.first()?;
    // From here the peer may be a VM that depends on us: one descriptor came, and it is a
    // userfaultfd (or /proc cannot say what it is, which is treated the same).
    *got_uffd = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_or(true, |l| l.as_os_str() == "anon_inode:[userfaultfd]");
    let uffd =
        Uffd::from_received(fd).map_err(|e| ServeError::from(HandshakeError::NotUserfaultfd(e)))?;
    for (bit, name) in UNFOLLOWED_EVENTS {
        if uffd.features() & u64::from(bit) != 0 {
            return Err(HandshakeError::UnfollowedEvent(name).into());
        }
    }
    let first = r.buf[..n].to_vec();
    let regions = r.rest_of_json(first)?;
    stream
        .set_read_timeout(None)
        .map_err(|source| ServeError::Io {
            op: "clear the read timeout",
            source,
        })?;
    Ok((regions, uffd))
}

/// A handshake being read, within one deadline for the whole of it.
struct Reader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
    timeout: Duration,
    buf: Vec<u8>,
}

impl Reader<'_> {
    fn arm(&self) -> Result<(), ServeError> {
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        self.stream
            .set_read_timeout(Some(left))
            .map_err(|source| ServeError::Io {
                op: "set a read timeout",
                source,
            })
    }

    /// The first message: its length in `buf`, and its one descriptor.
    fn first(&mut self) -> Result<(usize, OwnedFd), ServeError> {
        self.arm()?;
        let timeout = self.timeout;
        let (n, fds) = recv_with_fds(self.stream, &mut self.buf).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                HandshakeError::Silent(timeout).into()
            }
            _ => ServeError::Io {
                op: "receive the handshake",
                source: e,
            },
        })?;
        let mut fds = fds?;
        if n == 0 {
            return Err(HandshakeError::Empty.into());
        }
        match fds.len() {
            0 => Err(HandshakeError::NoDescriptor.into()),
            1 => Ok((n, fds.pop().expect("one"))),
            k => Err(HandshakeError::Descriptors(Some(k)).into()),
        }
    }

    fn cut_off(&self, json: &[u8]) -> ServeError {
        HandshakeError::CutOff {
            bytes: json.len(),
            timeout: self.timeout,
        }
        .into()
    }

    /// Reads until `json` parses as the regions, a refusal, or the deadline.
    fn rest_of_json(&mut self, mut json: Vec<u8>) -> Result<Vec<UffdRegion>, ServeError> {
        let mut first = true;
        loop {
            // A JSON array can only be whole once it ends in `]`: after the first read, the
            // text is parsed again only then (a peer sending a byte at a time costs no
            // re-parse each).
            let whole = first || json.trim_ascii_end().ends_with(b"]");
            first = false;
            if whole {
                match parse_regions(&json) {
                    Ok(r) => return Ok(r),
                    // Only a JSON document cut short may continue in a later read.
                    Err(e)
                        if !serde_json::from_slice::<serde_json::Value>(&json)
                            .err()
                            .is_some_and(|e| e.is_eof()) =>
                    {
                        return Err(e)
                    }
                    Err(_) => {}
                }
            }
            // The timeout is for the whole handshake: a peer trickling bytes is cut off.
            if Instant::now() >= self.deadline {
                return Err(self.cut_off(&json));
            }
            if json.len() >= MAX_HANDSHAKE_BYTES {
                return Err(HandshakeError::TooLong.into());
            }
            self.arm()?;
            let k = match (&*self.stream).read(&mut self.buf) {
                Ok(k) => k,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(self.cut_off(&json))
                }
                Err(source) => {
                    return Err(ServeError::Io {
                        op: "receive the handshake",
                        source,
                    })
                }
            };
            if k == 0 {
                return Err(HandshakeError::Disconnected(json.len()).into());
            }
            json.extend_from_slice(&self.buf[..k]);
        }
    }
}

impl Handshake {
    /// The regions, in the order the peer sent them.
    pub fn regions(&self) -> &[UffdRegion] {
        &self.regions
    }

    /// The peer's process id, from the socket (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Option<i32> {
        self.process.pid()
    }

    /// The checked regions, the descriptor and the socket, for a server of one's own (the
    /// lab's Firecracker-style peer). Every use of the descriptor is an `unsafe` ioctl.
    #[cfg(feature = "lab-internals")]
    pub fn into_parts(self) -> (Vec<UffdRegion>, OwnedFd, UnixStream) {
        (self.regions, self.uffd.into_fd(), self.peer)
    }
}

/// Descriptors one message may bring before it counts as garbage.
const MAX_FDS: usize = 8;

/// One `recvmsg`: bytes into `buf`, and the descriptors that came with them (each owned;
/// closed if the call then fails). The inner error says a message's descriptors were cut
/// short (`MSG_CTRUNC`).
pub(super) fn recv_with_fds(
    s: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Result<Vec<OwnedFd>, ServeError>)> {
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 32];
    // SAFETY: CMSG_SPACE is arithmetic.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<i32>()) as u32) };
    assert!(space as usize <= std::mem::size_of_val(&control));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as usize;
    let n = loop {
        // SAFETY: msg points at live iov (over buf) and control buffers of the lengths
        // given; the kernel writes within them.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: msg was filled by recvmsg; CMSG_FIRSTHDR/NXTHDR walk its control buffer
    // within msg_controllen, and each SCM_RIGHTS payload holds whole i32 descriptors that
    // are now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const i32;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<i32>();
                for k in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(k).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Ok((n, Err(HandshakeError::Descriptors(None).into())));
    }
    Ok((n, Ok(fds)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_firecracker_sends_and_refuses_the_rest() {
        let ok = br#"[{"base_host_virt_addr":139637976727552,"size":1048576,"offset":0,"page_size":4096,"page_size_kib":4096},
                      {"base_host_virt_addr":139637978824704,"size":2097152,"offset":1048576,"page_size":4096}]"#;
        let r = parse_regions(ok).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].offset, 1 << 20);
        // Old releases: no page size at all; 1.7-1.10: page_size_kib in KiB.
        let old = br#"[{"base_host_virt_addr":2097152,"size":4194304,"offset":0}]"#;
        assert_eq!(parse_regions(old).unwrap()[0].page_size, 4096);
        let kib =
            br#"[{"base_host_virt_addr":2097152,"size":4194304,"offset":0,"page_size_kib":2048}]"#;
        assert_eq!(parse_regions(kib).unwrap()[0].page_size, 2 << 20);
        for (bad, says) in [
            (&b"garbage"[..], "not Firecracker's JSON"),
            (b"[]", "no regions"),
            (br#"[{"size":4096,"offset":0}]"#, "not Firecracker's JSON"),
            (
                br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0},{"base_host_virt_addr":8192,"size":4096,"offset":8192}]"#,
                "overlap in the peer's address space",
            ),
            (
                br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0},{"base_host_virt_addr":65536,"size":4096,"offset":4096}]"#,
                "overlap in the memory file",
            ),
            (
                br#"[{"base_host_virt_addr":4097,"size":4096,"offset":0}]"#,
                "region 0 (host 0x1001)",
            ),
            (
                br#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":8192}]"#,
                "page size 8192",
            ),
            (
                br#"[{"base_host_virt_addr":18446744073709547520,"size":8192,"offset":0}]"#,
                "past the end of user address space",
            ),
            (
                br#"[{"base_host_virt_addr":4096,"size":8192,"offset":18446744073709547520}]"#,
                "+ size 0x2000 overflows 64 bits",
            ),
        ] {
            let e = parse_regions(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let many: Vec<String> = (0..=MAX_REGIONS as u64)
            .map(|i| {
                format!(
                    r#"{{"base_host_virt_addr":{},"size":4096,"offset":{}}}"#,
                    (i + 1) * 8192,
                    i * 4096
                )
            })
            .collect();
        let e = parse_regions(format!("[{}]", many.join(",")).as_bytes()).unwrap_err();
        assert!(e.to_string().contains("at most 32764"), "{e}");
    }

    #[test]
    fn region_refusals_name_the_json_field_at_fault() {
        for (bad, field) in [
            (
                &br#"[{"base_host_virt_addr":2101248,"size":2097152,"offset":0,"page_size":2097152}]"#[..],
                "base_host_virt_addr",
            ),
            (
                br#"[{"base_host_virt_addr":2097152,"size":2097152,"offset":4096,"page_size":2097152}]"#,
                "offset",
            ),
            (
                br#"[{"base_host_virt_addr":2097152,"size":4096,"offset":0,"page_size":2097152}]"#,
                "size",
            ),
            (
                br#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":16384}]"#,
                "page_size",
            ),
            (
                br#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size_kib":16}]"#,
                "page_size_kib",
            ),
        ] {
            match parse_regions(bad) {
                Err(ServeError::Handshake(e)) => {
                    assert_eq!(e.field(), Some(field), "{e}");
                    assert!(e.to_string().contains(field), "{e}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
