//! A real S3 server for tests and the lab: s3s-fs (objects as files under a scratch
//! folder) behind s3s's HTTP service with signature checking, on 127.0.0.1 at a port of the
//! kernel's choosing, in a thread of its own. No mock: clients speak S3 to it over TCP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

/// The access key id the server accepts.
pub const ACCESS_KEY: &str = "GMTESTACCESSKEY";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "gm-test-secret-3f9a1c77d2";

/// A running S3 server; stopped, joined and its folder removed on drop.
pub struct S3Server {
    addr: SocketAddr,
    root: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl S3Server {
    /// Starts one over a fresh folder named for `name`, with `buckets` made.
    pub fn start(name: &str, buckets: &[&str]) -> S3Server {
        let root = std::env::temp_dir().join(format!("gm-s3-{}-{name}", std::process::id()));
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
        let thread = std::thread::Builder::new()
            .name("s3-server".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(async move {
                    let fs = s3s_fs::FileSystem::new(&fs_root).expect("s3s-fs over the folder");
                    let mut b = S3ServiceBuilder::new(fs);
                    b.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
                    let service = b.build();
                    let listener = tokio::net::TcpListener::from_std(listener).expect("to tokio");
                    let http = ConnBuilder::new(TokioExecutor::new());
                    loop {
                        tokio::select! {
                            r = listener.accept() => {
                                let Ok((sock, _)) = r else { continue };
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
        S3Server {
            addr,
            root,
            stop: Some(tx),
            thread: Some(thread),
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
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
