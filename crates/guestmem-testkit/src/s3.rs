//! A real S3 server for tests and the lab: s3s-fs (objects as files under a scratch
//! folder) behind s3s's HTTP service with signature checking, on 127.0.0.1 at a port of the
//! kernel's choosing, in a thread of its own. No mock: clients speak S3 to it over TCP.
//!
//! One change to s3s-fs, in how it reads, not in what it answers (`ReadWhole`). s3s-fs
//! streams a GET's body through tokio's file in 4 KiB reads, each a hand-off to a blocking
//! thread (64 for a 256 KiB frame), and reads the whole object once more for its MD5 (the
//! ETag) on every GET. That made this server deliver 51-74 MiB/s on this 2-CPU host, and
//! every cold figure of the object-store lab measured it, not guestmem. Here a GET's body is
//! one read, on the thread that answers it (`read_range`); an object stored by a plain PUT (no metadata, no checksum) is answered
//! with the ETag s3s-fs gave it then, while its file is unchanged; any other object, or a
//! GET with conditions, is answered by s3s-fs, only its body read in one piece. Measured,
//! with that read still handed to a blocking thread: every frame of 1 GiB fetched by 16
//! threads at 336 MiB/s, against 74 MiB/s (`guestmem-lab object-store`, the line on what
//! the store delivers; through the lab's proxy at 0 ms, 755-875 MiB/s at c938b8b).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::service::S3ServiceBuilder;
use s3s::S3Result;

use read_whole::ReadWhole;

mod read_whole;

/// The access key id the server accepts.
pub const ACCESS_KEY: &str = "GMTESTACCESSKEY";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "gm-test-secret-3f9a1c77d2";

/// What a test may ask of a running server about its clients.
#[derive(Default)]
struct Seen {
    /// TCP connections accepted.
    connections: std::sync::atomic::AtomicU64,
    /// The key of every GET answered, in the order they came, once asked for (`log_gets`).
    gets: std::sync::Mutex<Option<Vec<String>>>,
    /// How long every HEAD waits before it is answered, microseconds (`delay_heads`).
    head_delay_us: std::sync::atomic::AtomicU64,
    /// How long every GET waits before it is answered, microseconds (`delay_gets`).
    get_delay_us: std::sync::atomic::AtomicU64,
    /// The key accepted (`rotate_key`).
    key: std::sync::RwLock<Keys>,
}

/// The one access key accepted and its secret, when not [`ACCESS_KEY`], and the keys
/// rotated away.
#[derive(Clone, Default)]
struct Keys(Option<(String, String)>, Vec<String>);

/// The server's signature check: one access key, [`ACCESS_KEY`] until rotated.
struct OneKey(std::sync::Arc<Seen>);

#[async_trait::async_trait]
impl s3s::auth::S3Auth for OneKey {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<s3s::auth::SecretKey> {
        let Keys(key, old) = self.0.key.read().expect("the server's key").clone();
        let (k, secret) = key.unwrap_or_else(|| (ACCESS_KEY.into(), SECRET_KEY.into()));
        if access_key == k {
            Ok(secret.into())
        } else if old.iter().any(|o| o == access_key) {
            // As AWS answers a session's key once its token has expired.
            Err(s3s::s3_error!(
                ExpiredToken,
                "the provided token has expired"
            ))
        } else {
            Err(s3s::s3_error!(InvalidAccessKeyId, "no such access key"))
        }
    }
}

/// A running S3 server; stopped, joined and its folder removed on drop.
pub struct S3Server {
    addr: SocketAddr,
    root: PathBuf,
    seen: std::sync::Arc<Seen>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Whether the calling thread runs at `nice` (0 asks for nothing), or what it runs at.
fn took_nice(nice: i32) -> Result<(), String> {
    if nice == 0 {
        return Ok(());
    }
    // getpriority returns -1 for a nice of -1 too: errno tells an error apart.
    // SAFETY: errno's location is this thread's; PRIO_PROCESS with 0 names the calling
    // thread; no memory passed.
    let got = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    let e = std::io::Error::last_os_error();
    if got == -1 && e.raw_os_error().unwrap_or(0) != 0 {
        return Err(format!("getpriority: {e}"));
    }
    if got != nice {
        return Err(format!(
            "it runs at {got} (setpriority was refused: a nice below 0 needs CAP_SYS_NICE, \
             and a value is kept within -20..=19)"
        ));
    }
    Ok(())
}

impl S3Server {
    /// Starts one over a fresh folder named for `name`, with `buckets` made.
    pub fn start(name: &str, buckets: &[&str]) -> S3Server {
        S3Server::start_in(&std::env::temp_dir(), name, buckets)
    }

    /// [`S3Server::start`] with its folder in `parent`: a tmpfs, say, where the store
    /// stands for one on other machines and its file system's work must not weigh on
    /// this host's CPUs (on this host's ext4, its inode allocations took half of both
    /// CPUs while a move's diff was pushed).
    pub fn start_in(parent: &Path, name: &str, buckets: &[&str]) -> S3Server {
        S3Server::start_niced(parent, name, buckets, 0)
    }

    /// [`S3Server::start_in`] with its threads at `nice` (19: they take only what this
    /// host's CPUs have to spare; 0 leaves them at the process's own): where the store
    /// stands for one on other machines and its CPU must not be taken from what the lab
    /// measures on this host. Panics as [`S3Server::try_start_niced`] refuses.
    pub fn start_niced(parent: &Path, name: &str, buckets: &[&str], nice: i32) -> S3Server {
        S3Server::try_start_niced(parent, name, buckets, nice).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`S3Server::start_niced`], refused, with nothing left behind, when its threads do
    /// not run at `nice` (a value below 0 without the right to it, or past 19): a run
    /// would record a nice it did not have.
    pub fn try_start_niced(
        parent: &Path,
        name: &str,
        buckets: &[&str],
        nice: i32,
    ) -> Result<S3Server, String> {
        let root = parent.join(format!("gm-s3-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the S3 server's folder");
        for b in buckets {
            std::fs::create_dir_all(root.join(b)).expect("create a bucket");
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("its address");
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let fs_root = root.clone();
        let seen = std::sync::Arc::new(Seen::default());
        let seen_here = std::sync::Arc::clone(&seen);
        // Linux keeps a nice value a thread: each of the server's sets its own.
        let set_nice = move || {
            if nice != 0 {
                // SAFETY: PRIO_PROCESS with 0 names the calling thread; no memory passed.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
            }
        };
        // Whether the nice value took, told by the server's first thread (each of its
        // runtime's threads asks as it does, with the same rights).
        let (niced_tx, niced) = std::sync::mpsc::channel::<Result<(), String>>();
        let thread = std::thread::Builder::new()
            .name("s3-server".into())
            .spawn(move || {
                set_nice();
                let _ = niced_tx.send(took_nice(nice));
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("s3-server-rt")
                    .on_thread_start(set_nice)
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(async move {
                    let mut b = S3ServiceBuilder::new(ReadWhole::new(
                        fs_root,
                        std::sync::Arc::clone(&seen_here),
                    ));
                    b.set_auth(OneKey(std::sync::Arc::clone(&seen_here)));
                    let service = b.build();
                    let listener = tokio::net::TcpListener::from_std(listener).expect("to tokio");
                    let http = ConnBuilder::new(TokioExecutor::new());
                    loop {
                        tokio::select! {
                            r = listener.accept() => {
                                let Ok((sock, _)) = r else { continue };
                                seen_here.connections.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                let conn = http.serve_connection(TokioIo::new(sock), service.clone()).into_owned();
                                tokio::spawn(async move { let _ = conn.await; });
                            }
                            _ = &mut rx => break,
                        }
                    }
                });
                rt.shutdown_timeout(std::time::Duration::from_secs(1));
            })
            .expect("start the S3 server's thread");
        let server = S3Server {
            addr,
            root,
            seen,
            stop: Some(tx),
            thread: Some(thread),
        };
        // Refused: dropped, it stops its thread and removes its folder.
        match niced.recv() {
            Ok(Ok(())) => Ok(server),
            Ok(Err(e)) => Err(format!("the S3 server's threads at nice {nice}: {e}")),
            Err(_) => Err("the S3 server's thread ended as it started".into()),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The folder of `bucket` (its objects are files under it, by key).
    pub fn bucket_dir(&self, bucket: &str) -> PathBuf {
        self.root.join(bucket)
    }

    /// The environment a client needs to reach it: the AWS conventions.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Stops answering (the listener closed; connections refused from now on).
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Its root folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// TCP connections it has accepted so far.
    pub fn connections(&self) -> u64 {
        self.seen
            .connections
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// From now on, the key of every GET is kept, in the order the GETs came ([`S3Server::gets`]).
    pub fn log_gets(&self) {
        let mut g = self.seen.gets.lock().expect("the GET log");
        g.get_or_insert_with(Vec::new);
    }

    /// From now on, every HEAD is answered `delay` after it came (a store farther away than
    /// this host: requests sent at once are all in flight together).
    pub fn delay_heads(&self, delay: std::time::Duration) {
        self.seen.head_delay_us.store(
            delay.as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// From now on, every GET is answered `delay` after it came (logged as it comes).
    pub fn delay_gets(&self, delay: std::time::Duration) {
        self.seen.get_delay_us.store(
            delay.as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// From now on, requests are accepted signed with `key` and `secret` only, as a
    /// session's credentials replaced by the next: one signed with a key rotated away is
    /// answered as AWS answers an expired token (400 `ExpiredToken`), any other key 403
    /// `InvalidAccessKeyId`.
    pub fn rotate_key(&self, key: &str, secret: &str) {
        let mut k = self.seen.key.write().expect("the server's key");
        let was = k.0.take().map_or(ACCESS_KEY.into(), |(was, _)| was);
        k.1.push(was);
        k.0 = Some((key.into(), secret.into()));
    }

    /// The keys of the GETs since [`S3Server::log_gets`], in the order they came.
    pub fn gets(&self) -> Vec<String> {
        let g = self.seen.gets.lock().expect("the GET log");
        g.clone().unwrap_or_default()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[cfg(test)]
mod tests {
    use object_store::{aws::AmazonS3Builder, ObjectStore, ObjectStoreExt, PutOptions, PutPayload};

    /// What a client gets: the bytes of a GET (whole and a range) and its ETag, for an object
    /// put plainly (read whole) and one put with a content type (left to s3s-fs).
    #[test]
    fn a_get_answers_as_s3s_fs_does() {
        let s3 = super::S3Server::start("get-answers", &["bucket"]);
        let store = AmazonS3Builder::new()
            .with_bucket_name("bucket")
            .with_endpoint(s3.endpoint())
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region("us-east-1")
            .with_access_key_id(super::ACCESS_KEY)
            .with_secret_access_key(super::SECRET_KEY)
            .build()
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let typed = PutOptions {
            attributes: [(
                object_store::Attribute::ContentType,
                object_store::AttributeValue::from("application/x-test"),
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        rt.block_on(async {
            let (plain, attrs) = (&"plain".into(), &"typed".into());
            store
                .put(plain, PutPayload::from(data.clone()))
                .await
                .unwrap();
            store
                .put_opts(attrs, PutPayload::from(data.clone()), typed)
                .await
                .unwrap();
            let mut etags = Vec::new();
            for key in [plain, attrs] {
                let got = store.get(key).await.unwrap();
                etags.push(got.meta.e_tag.clone().expect("an ETag"));
                assert_eq!(got.meta.size, data.len() as u64);
                assert_eq!(&got.bytes().await.unwrap()[..], &data[..], "{key}");
                let part = store.get_range(key, 1000..200_000).await.unwrap();
                assert_eq!(&part[..], &data[1000..200_000], "{key}");
                assert!(store.get_range(key, 400_000..400_010).await.is_err());
            }
            assert_eq!(etags[0], etags[1], "both are the MD5 of the same bytes");
            // Replaced (by a PUT of the same length, by a copy), then deleted: never the old
            // bytes, never the old ETag.
            let other: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
            store
                .put(plain, PutPayload::from(other.clone()))
                .await
                .unwrap();
            let got = store.get(plain).await.unwrap();
            assert_ne!(got.meta.e_tag.as_ref(), Some(&etags[0]));
            assert_eq!(&got.bytes().await.unwrap()[..], &other[..]);
            store.copy(attrs, plain).await.unwrap();
            let got = store.get(plain).await.unwrap();
            assert_eq!(got.meta.e_tag.as_ref(), Some(&etags[1]));
            assert_eq!(&got.bytes().await.unwrap()[..], &data[..]);
            store
                .put(plain, PutPayload::from(vec![9u8; 1000]))
                .await
                .unwrap();
            let got = store.get(plain).await.unwrap().bytes().await.unwrap();
            assert_eq!(&got[..], &[9u8; 1000][..]);
            store.delete(plain).await.unwrap();
            assert!(matches!(
                store.get(plain).await,
                Err(object_store::Error::NotFound { .. })
            ));
        });
    }
}

#[cfg(test)]
mod nice_tests {
    /// The nice value of this process's threads named `comm`.
    fn nice_of(comm: &str) -> Vec<i64> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == comm)
            })
            .filter_map(|e| {
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                // After the comm's closing parenthesis: state is field 3, nice field 19.
                let rest = &stat[stat.rfind(')')? + 2..];
                rest.split_whitespace().nth(16)?.parse().ok()
            })
            .collect()
    }

    /// The calling thread's nice value.
    fn own_nice() -> i32 {
        // SAFETY: PRIO_PROCESS with 0 names the calling thread; no memory passed.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
    }

    #[test]
    fn a_niced_server_runs_at_its_nice_and_a_refused_one_is_told() {
        // Above the test's own value (which may be raised: `nice cargo test`), which any
        // user may ask for.
        let base = own_nice();
        if base >= 18 {
            eprintln!("skipped: this test runs at nice {base}, no higher value to ask for");
            return;
        }
        let want = (base + 7).min(19);
        let s3 = super::S3Server::start_niced(&std::env::temp_dir(), "niced", &["b"], want);
        // Another test's server (at the process's own value) may be running beside it.
        let n = nice_of("s3-server");
        assert!(n.contains(&i64::from(want)), "{n:?}");
        drop(s3);
        // A thread is told what it runs at when that is not what was asked for.
        let told = std::thread::spawn(move || {
            // SAFETY: PRIO_PROCESS with 0 names the calling thread; no memory passed.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, base + 1) };
            let at = own_nice();
            // Not 0, which asks for nothing.
            let other = if at + 1 == 0 { at + 2 } else { at + 1 };
            (at, super::took_nice(at), super::took_nice(other))
        })
        .join()
        .unwrap();
        assert_eq!(told.1, Ok(()));
        let e = told.2.unwrap_err();
        assert!(e.contains(&format!("runs at {}", told.0)), "{e}");
    }
}
