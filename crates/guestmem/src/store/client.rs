//! The S3 client: object_store's, driven from plain threads through a runtime of its own
//! (and a fault's own GETs through a second, [`Lane`]), configured as every AWS tool is
//! (environment first, then the profile files), and the one place a credential is held.
//! Every error leaves here redacted. The same client reads a move's source host
//! (`http://HOST:PORT`, the frames it serves in the store's layout) and holds a move's
//! frames in memory, so that there is one fetch path whatever holds a frame.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::http::HttpBuilder;
use object_store::memory::InMemory;
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use super::profile::ProfileFiles;
use super::StoreError;
use creds::{FromProfile, Secrets};
use lane::Lane;
use read::{capped, Capped};

mod creds;
mod lane;
mod read;
mod write;

/// Objects up to this size are written with one PUT; larger ones in parts of this size.
pub(crate) const MULTIPART_BYTES: usize = 8 << 20;
/// Connections to the store the pool keeps idle at most.
const IDLE_PER_HOST: usize = 64;
/// Threads of the client's runtime (its requests' I/O; the callers' threads wait).
pub(super) const RUNTIME_THREADS: usize = 2;
/// Connections the fault lane opens ahead of a VM's first faults ([`Client::warm`]).
pub(super) const LANE_WARM: usize = 8;

/// A connection to one bucket.
pub struct Client {
    store: Arc<dyn ObjectStore>,
    rt: Rt,
    bucket: String,
    /// What a key is named under in messages: `s3://BUCKET`, `http://HOST:PORT`, `mem://NAME`.
    shown_root: String,
    /// Where requests go, for messages (no credential in it).
    endpoint: String,
    /// Strings never to let out: the secret key, the session token, the key id (the last
    /// few sets, where they follow the profile files), the endpoint's password.
    secrets: Arc<Secrets>,
    /// The credentials, where they follow the profile files (a refusal then may pass once
    /// the next are written: see `creds`).
    creds: Option<Arc<FromProfile>>,
    /// A move's source, read by a faulting thread itself ([`super::direct`]).
    direct: Option<super::direct::Direct>,
    /// A locked move source's key for the seals of pieces named later.
    seal: Option<[u8; 32]>,
    /// What a store's fault lane is built from, on first use (none: not a store's client).
    lane_from: Option<AmazonS3Builder>,
    /// Where a fault's own GETs go, once built: see [`Lane`].
    lane: std::sync::OnceLock<Option<Lane>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("bucket", &self.bucket)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// An object as a listing names it.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Its key.
    pub key: String,
    /// Bytes.
    pub size: u64,
    /// When it was written, seconds since the epoch (the store's clock).
    pub modified: i64,
}

impl Client {
    /// Connects to `bucket` as the AWS conventions say: the endpoint from
    /// `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (else AWS itself), credentials from
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`, the region from
    /// `AWS_REGION` or `AWS_DEFAULT_REGION`, each else from the profile `AWS_PROFILE` in the
    /// shared config and credentials files. Requests are path-style (`endpoint/bucket/key`,
    /// as local S3 servers on an address and port need) whenever an endpoint is given,
    /// virtual-hosted for AWS itself. Nothing is sent yet: see [`Client::check`].
    pub fn connect(bucket: &str) -> Result<Client, StoreError> {
        Client::connect_with(bucket, &|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`Client::connect`] with the environment read through `env`.
    pub fn connect_with(
        bucket: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Client, StoreError> {
        let files = ProfileFiles::locate(env);
        let profile = files.read();
        let pick = |vars: &[&str], from_profile: &Option<String>| {
            vars.iter()
                .find_map(|v| env(v))
                .or_else(|| from_profile.clone())
        };
        // The key, secret and token come as one set from the first source that has a key
        // and a secret (as the AWS SDKs take them): an environment's long-term key signed
        // with a profile's temporary token is refused by the store.
        let (key_id, secret, token, from_profile) =
            match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
                (Some(k), Some(s)) => (Some(k), Some(s), env("AWS_SESSION_TOKEN"), false),
                _ => (
                    profile.access_key_id.clone(),
                    profile.secret_access_key.clone(),
                    profile.session_token.clone(),
                    true,
                ),
            };
        let region = pick(&["AWS_REGION", "AWS_DEFAULT_REGION"], &profile.region)
            .unwrap_or_else(|| "us-east-1".into());
        let endpoint = pick(
            &["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"],
            &profile.endpoint_url,
        );
        // An endpoint may carry a user and password (`http://user:pass@host`): they are
        // secrets too, and left out where the endpoint is shown.
        let userinfo = endpoint.as_deref().and_then(userinfo);
        let password = userinfo
            .as_deref()
            .and_then(|u| u.split_once(':'))
            .map(|(_, p)| p.to_string());
        let secrets = Arc::new(Secrets::new(
            [userinfo.clone(), password].into_iter().flatten().collect(),
            [&key_id, &secret, &token]
                .into_iter()
                .flatten()
                .cloned()
                .collect(),
        ));
        let options = ClientOptions::new()
            .with_allow_http(
                endpoint
                    .as_deref()
                    .is_some_and(|e| e.starts_with("http://")),
            )
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(60))
            .with_pool_max_idle_per_host(IDLE_PER_HOST);
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region(&region)
            .with_client_options(options)
            // The fetch path retries itself, bounded by its deadline; a request here is
            // retried a little for the push and the listings.
            .with_retry(RetryConfig {
                max_retries: 3,
                retry_timeout: Duration::from_secs(30),
                ..RetryConfig::default()
            });
        // object_store's own setting, for a store that does not take `If-None-Match`
        // (`disabled`): a manifest is then written after a look, not on a condition.
        if let Some(v) = env("AWS_CONDITIONAL_PUT") {
            b = b.with_config(AmazonS3ConfigKey::ConditionalPut, v);
        }
        let shown = match &endpoint {
            Some(e) => {
                b = b
                    .with_endpoint(e)
                    .with_config(AmazonS3ConfigKey::VirtualHostedStyleRequest, "false");
                match &userinfo {
                    Some(u) => e.replacen(&format!("{u}@"), "", 1),
                    None => e.clone(),
                }
            }
            None => {
                b = b.with_virtual_hosted_style_request(true);
                format!("https://{bucket}.s3.{region}.amazonaws.com")
            }
        };
        if let (Some(k), Some(s)) = (&key_id, &secret) {
            let set = object_store::aws::AwsCredential {
                key_id: k.clone(),
                secret_key: s.clone(),
                token: token.clone(),
            };
            if !creds::usable(&set) {
                return Err(StoreError::Config {
                    bucket: bucket.into(),
                    reason: format!(
                        "the access key id, secret key or session token (from {}) is empty or \
                         holds a byte a request header cannot carry (a space, a control \
                         character or one past ASCII)",
                        if from_profile {
                            "the profile files"
                        } else {
                            "the environment"
                        }
                    ),
                });
            }
        }
        let mut creds = None;
        match (&key_id, &secret) {
            (Some(k), Some(s)) if from_profile => {
                // Read again as the files change (a helper writes the next session token
                // before the last expires): see `creds`.
                let cred = object_store::aws::AwsCredential {
                    key_id: k.clone(),
                    secret_key: s.clone(),
                    token: token.clone(),
                };
                let from = Arc::new(FromProfile::new(files, cred, Arc::clone(&secrets)));
                creds = Some(Arc::clone(&from));
                b = b.with_credentials(from);
            }
            (Some(k), Some(s)) => {
                b = b.with_access_key_id(k).with_secret_access_key(s);
                if let Some(t) = &token {
                    b = b.with_token(t);
                }
            }
            (None, None) => {
                // No key here: object_store's providers that fetch and refresh their own
                // (a web identity, as on EKS; a container's, as on ECS and EKS Pod
                // Identity; else the instance's metadata service), configured as the AWS
                // SDKs read them.
                for (key, v) in fetching_providers(env).map_err(|reason| StoreError::Config {
                    bucket: bucket.into(),
                    reason,
                })? {
                    b = b.with_config(key, v);
                }
            }
            _ => {
                return Err(StoreError::Config {
                    bucket: bucket.into(),
                    reason: "an access key id without a secret key, or a secret key without an id (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or the profile)".into(),
                })
            }
        }
        let redact = |s: String| secrets.redact(s);
        let build = |b: AmazonS3Builder| {
            b.build().map_err(|e| StoreError::Config {
                bucket: bucket.into(),
                reason: redact(e.to_string()),
            })
        };
        Ok(Client {
            store: Arc::new(build(b.clone())?),
            rt: Rt(Some(runtime(bucket, RUNTIME_THREADS, "guestmem-s3")?)),
            bucket: bucket.into(),
            shown_root: format!("s3://{bucket}"),
            endpoint: shown,
            secrets,
            creds,
            direct: None,
            seal: None,
            lane_from: Some(b),
            lane: std::sync::OnceLock::new(),
        })
    }

    /// A move's source host at `base` (`http://HOST:PORT`): the frames it serves, read-only,
    /// in the store's layout. No credential: the move's network is the operator's to trust
    /// (docs/move.md).
    pub fn peer(base: &str) -> Result<Client, StoreError> {
        Client::peer_with(base, None)
    }

    /// [`Client::peer`] for a source whose page server is locked: every request carries
    /// `token` (`authorization: Guestmem TOKEN`), which no error shows.
    /// Its pieces named later come sealed with `seal` ([`super::frame::seal`]).
    pub(crate) fn peer_locked(
        base: &str,
        token: &str,
        seal: [u8; 32],
    ) -> Result<Client, StoreError> {
        let mut c = Client::peer_with(base, Some(token))?;
        c.seal = Some(seal);
        Ok(c)
    }

    /// The key a move source seals its pieces named later with (a locked source).
    pub(crate) fn seal(&self) -> Option<&[u8; 32]> {
        self.seal.as_ref()
    }

    fn peer_with(base: &str, token: Option<&str>) -> Result<Client, StoreError> {
        let bad = |reason: String| StoreError::Config {
            bucket: base.into(),
            reason,
        };
        if !base.starts_with("http://") {
            return Err(bad("a move's source is http://HOST:PORT".into()));
        }
        let mut headers = hyper::header::HeaderMap::new();
        if let Some(t) = token {
            let mut v = hyper::header::HeaderValue::from_str(&format!("Guestmem {t}"))
                .map_err(|_| bad("a token that is not a header's value".into()))?;
            v.set_sensitive(true);
            headers.insert(hyper::header::AUTHORIZATION, v);
        }
        let options = ClientOptions::new()
            .with_default_headers(headers)
            .with_allow_http(true)
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(60))
            .with_pool_max_idle_per_host(IDLE_PER_HOST)
            // Closed here before the source's server would close it (30 s without a request).
            .with_pool_idle_timeout(Duration::from_secs(20));
        let store = HttpBuilder::new()
            .with_url(base)
            .with_client_options(options)
            .with_retry(RetryConfig {
                max_retries: 0,
                ..RetryConfig::default()
            })
            .build()
            .map_err(|e| bad(e.to_string()))?;
        Ok(Client {
            store: Arc::new(store),
            rt: Rt(Some(runtime(base, RUNTIME_THREADS, "guestmem-s3")?)),
            bucket: base.into(),
            shown_root: base.trim_end_matches('/').into(),
            endpoint: base.into(),
            secrets: Arc::new(Secrets::new(
                token.map(String::from).into_iter().collect(),
                Vec::new(),
            )),
            creds: None,
            direct: super::direct::Direct::new(base, token),
            seal: None,
            lane_from: None,
            lane: std::sync::OnceLock::new(),
        })
    }

    /// Objects held in this process's memory under `name` (a move's frames on its source
    /// host, served from there by [`super::peer::PeerServer`]).
    pub fn in_memory(name: &str) -> Result<Client, StoreError> {
        Ok(Client {
            store: Arc::new(InMemory::new()),
            rt: Rt(Some(runtime(name, RUNTIME_THREADS, "guestmem-s3")?)),
            bucket: name.into(),
            shown_root: format!("mem://{name}"),
            endpoint: format!("mem://{name}"),
            secrets: Arc::default(),
            creds: None,
            direct: None,
            seal: None,
            lane_from: None,
            lane: std::sync::OnceLock::new(),
        })
    }

    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Where requests go.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `s3://bucket/key` (or the peer's, or memory's, root and the key).
    pub(crate) fn url(&self, key: &str) -> String {
        format!("{}/{key}", self.shown_root)
    }

    /// `s` with every credential replaced by `[redacted]`.
    pub(crate) fn redact(&self, s: String) -> String {
        self.secrets.redact(s)
    }

    /// Runs `f` to its end on the client's runtime, from a thread outside it.
    pub(crate) fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.get().block_on(f)
    }

    /// A move's source, to read from the calling thread; `None` for a store.
    pub(crate) fn direct(&self) -> Option<&super::direct::Direct> {
        self.direct.as_ref()
    }

    /// The runtime, to spawn background requests on.
    pub(crate) fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.get().handle()
    }

    /// The error of request `op` on `key`.
    pub(crate) fn error(&self, op: &'static str, key: &str, e: object_store::Error) -> StoreError {
        // The client maps the store's 404, 403 and 401 to these; a listing's errors come
        // back generic, and are retried like any other (none is retried past its deadline).
        // A refusal is final, but one for a profile's credentials (an expired session
        // token, AWS's 400 `ExpiredToken`; a key replaced, 403 `InvalidAccessKeyId`): the
        // files are read again before the next request, and a fault asks again until its
        // deadline (a helper late with the next token; a key revoked for good costs the
        // deadline, then the VM is ended as for a store gone away). A policy's refusal
        // (`AccessDenied`) stays final.
        let text = e.to_string();
        let refused = matches!(
            e,
            object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        );
        let for_credentials = match &self.creds {
            Some(c) if creds::refused_for_credentials(&text) => {
                c.look_again();
                true
            }
            _ => false,
        };
        let permanent =
            matches!(e, object_store::Error::NotFound { .. }) || (refused && !for_credentials);
        StoreError::Request {
            op,
            url: self.url(key),
            reason: self.redact(text),
            permanent,
        }
    }
}

/// A client's runtime. Dropped with the client: outside any runtime, it waits for the work
/// under way on its blocking threads and drops what has not started; on a runtime's thread
/// (the last holder of the client a task of its own), where a runtime cannot wait for
/// itself, it is shut down without waiting.
struct Rt(Option<tokio::runtime::Runtime>);

impl Rt {
    fn get(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("taken only on drop")
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            }
        }
    }
}

/// A client's runtime of `threads` threads named `name`: its requests' I/O (the callers'
/// threads wait).
fn runtime(what: &str, threads: usize, name: &str) -> Result<tokio::runtime::Runtime, StoreError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|source| StoreError::Io {
            op: "start the object store's runtime for",
            path: what.into(),
            source,
        })
}

/// The `user:pass` of a URL's authority, if it has one.
fn userinfo(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    authority.rsplit_once('@').map(|(u, _)| u.to_string())
}

/// The settings of object_store's providers that fetch credentials themselves, from the
/// variables the AWS SDKs read. object_store takes the first that is complete (a web
/// identity, a container's relative URI, a container's full URI with its token file) and
/// otherwise asks the instance's metadata service, silently; a half-given provider is refused
/// here instead, naming what is missing, so that it is not mistaken for the instance's role.
fn fetching_providers(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(AmazonS3ConfigKey, String)>, String> {
    use AmazonS3ConfigKey as K;
    let web = (env("AWS_WEB_IDENTITY_TOKEN_FILE"), env("AWS_ROLE_ARN"));
    let relative = env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
    let full = env("AWS_CONTAINER_CREDENTIALS_FULL_URI");
    let token_file = env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
    // A complete container provider is taken past a web identity given by halves, as the
    // AWS SDKs skip one (a stray AWS_ROLE_ARN in an ECS task, say).
    let container = relative.is_some() || (full.is_some() && token_file.is_some());
    match &web {
        _ if container => {}
        (Some(_), None) => {
            return Err(
                "AWS_WEB_IDENTITY_TOKEN_FILE is set without AWS_ROLE_ARN (a web \
                        identity needs the role to assume)"
                    .into(),
            )
        }
        (None, Some(_)) => {
            return Err(
                "AWS_ROLE_ARN is set without AWS_WEB_IDENTITY_TOKEN_FILE (without a \
                        web identity token there is nothing to assume it with)"
                    .into(),
            )
        }
        _ => {}
    }
    if relative.is_none() && full.is_some() && token_file.is_none() {
        return Err(if env("AWS_CONTAINER_AUTHORIZATION_TOKEN").is_some() {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI is set with AWS_CONTAINER_AUTHORIZATION_TOKEN: \
             the store client reads the token only from a file; write it to one and name it \
             in AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"
        } else {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI is set without \
             AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, which the store client needs to ask it"
        }
        .into());
    }
    let chosen = web.0.is_some() || relative.is_some() || full.is_some();
    if !chosen && env("AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Err(
            "no credentials: none in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or \
                    the profile, no web identity or container provider, and the instance's \
                    metadata service is off (AWS_EC2_METADATA_DISABLED)"
                .into(),
        );
    }
    let mut out = Vec::new();
    // A web identity given by halves (past a container provider) is not passed on:
    // object_store would take the half for a whole one's.
    let whole_web = web.0.is_some() && web.1.is_some();
    for (var, key) in [
        ("AWS_WEB_IDENTITY_TOKEN_FILE", K::WebIdentityTokenFile),
        ("AWS_ROLE_ARN", K::RoleArn),
        ("AWS_ROLE_SESSION_NAME", K::RoleSessionName),
        ("AWS_ENDPOINT_URL_STS", K::StsEndpoint),
        (
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            K::ContainerCredentialsRelativeUri,
        ),
        (
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            K::ContainerCredentialsFullUri,
        ),
        (
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            K::ContainerAuthorizationTokenFile,
        ),
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", K::MetadataEndpoint),
    ] {
        let web_var = matches!(var, "AWS_WEB_IDENTITY_TOKEN_FILE" | "AWS_ROLE_ARN");
        if let (Some(v), false) = (env(var), web_var && !whole_web) {
            out.push((key, v));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::Client;

    /// An answer that says 100 bytes but comes chunked, and goes on (a broken store, or
    /// one in the middle of a plain `http://` endpoint), is cut off once past what the GET
    /// can take: the client hangs up after at most that much, not after the whole body.
    /// Before, the body was read whole (here 256 MiB) and refused after.
    #[test]
    fn a_chunked_answer_past_its_cap_is_cut_off_as_it_comes() {
        use std::io::Write;
        let (addr, store) = guestmem_testkit::http_once(|mut w| {
            w.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\ntransfer-encoding: chunked\r\n\
                  etag: \"x\"\r\nlast-modified: Sun, 29 Nov 2026 00:00:00 GMT\r\n\r\n",
            )
            .unwrap();
            let chunk = [b'x'; 1 << 16];
            let mut sent = 0usize;
            while sent < 256 << 20 {
                let ok = w.write_all(b"10000\r\n").is_ok()
                    && w.write_all(&chunk).is_ok()
                    && w.write_all(b"\r\n").is_ok();
                if !ok {
                    break;
                }
                sent += chunk.len();
            }
            sent
        });
        let get = |k: &str| match k {
            "AWS_ENDPOINT_URL" => Some(format!("http://{addr}")),
            "AWS_ACCESS_KEY_ID" => Some("GMKEYID0".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("gmsecret0".to_string()),
            _ => None,
        };
        let c = Client::connect_with("b", &get).unwrap();
        let got = c.block_on(c.get_capped("frames/x", 1 << 20));
        let e = got.expect_err("taken");
        assert!(e.to_string().contains("past the 1048576"), "{e}");
        drop(c);
        let sent = store.join().unwrap();
        // The socket's buffers hold a few MiB more than the client read.
        assert!(
            sent < 64 << 20,
            "{} MiB sent before the client hung up",
            sent >> 20
        );
    }

    /// A profile's credentials are read again as its files change, at once after the store
    /// refuses them for what they are (an expired token), and a refusal of them is not
    /// final; a refusal of keys from the environment is.
    #[test]
    fn a_profiles_credentials_are_read_again_when_its_files_change() {
        use guestmem_testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};
        let s3 = S3Server::start("rotate", &["snaps"]);
        std::fs::write(s3.bucket_dir("snaps").join("x"), b"frame").unwrap();
        let scratch = guestmem_testkit::Scratch::new("rotate");
        let creds = scratch.join("credentials");
        let write = |key: &str, secret: &str, token: &str| {
            format!(
                "[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\naws_session_token = {token}\n"
            )
        };
        std::fs::write(&creds, write(ACCESS_KEY, SECRET_KEY, "token-1")).unwrap();
        let (endpoint, at, none) = (
            s3.endpoint(),
            creds.display().to_string(),
            scratch.join("no-config").display().to_string(),
        );
        let env = move |k: &str| match k {
            "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
            "AWS_SHARED_CREDENTIALS_FILE" => Some(at.clone()),
            "AWS_CONFIG_FILE" => Some(none.clone()),
            _ => None,
        };
        let c = Client::connect_with("snaps", &env).unwrap();
        assert_eq!(c.get("x").unwrap().as_deref(), Some(&b"frame"[..]));

        // The session ends: the store answers its key as AWS does an expired token (400
        // `ExpiredToken`), which has the files read again before the next request.
        s3.rotate_key("GMROTATEDKEY2", "gm-rotated-secret-2");
        let e = c.get("x").unwrap_err();
        assert!(e.is_transient(), "{e}");
        let said = e.to_string();
        assert!(
            said.contains("400") && said.contains("ExpiredToken"),
            "{said}"
        );
        assert!(
            !said.contains(SECRET_KEY) && !said.contains("token-1"),
            "{said}"
        );
        // A helper writes the next key as a new file renamed over the old.
        let next = scratch.join("credentials.new");
        std::fs::write(
            &next,
            write("GMROTATEDKEY2", "gm-rotated-secret-2", "token-2"),
        )
        .unwrap();
        std::fs::rename(&next, &creds).unwrap();
        std::thread::sleep(super::creds::FORCED_GAP);
        assert_eq!(c.get("x").unwrap().as_deref(), Some(&b"frame"[..]));
        let said = c.redact("gm-rotated-secret-2 token-2 GMROTATEDKEY2".into());
        assert_eq!(said, "[redacted] [redacted] [redacted]");

        // With no refusal, a change is seen within `RECHECK`; here written in place, at
        // the same length (its change time may not tell it).
        s3.rotate_key("GMROTATEDKEY3", "gm-rotated-secret-3");
        std::fs::write(
            &creds,
            write("GMROTATEDKEY3", "gm-rotated-secret-3", "token-3"),
        )
        .unwrap();
        std::thread::sleep(super::creds::RECHECK + std::time::Duration::from_millis(100));
        assert_eq!(c.get("x").unwrap().as_deref(), Some(&b"frame"[..]));

        // A key the store does not know (403 `InvalidAccessKeyId`): not final for a
        // profile's, which a helper may be about to replace; the files are read again at
        // once.
        std::fs::write(
            &creds,
            write("GMUNKNOWNKEY4", "gm-unknown-secret", "token-4"),
        )
        .unwrap();
        std::thread::sleep(super::creds::RECHECK + std::time::Duration::from_millis(100));
        let e = c.get("x").unwrap_err();
        assert!(e.is_transient() && e.to_string().contains("403"), "{e}");
        std::fs::write(
            &creds,
            write("GMROTATEDKEY3", "gm-rotated-secret-3", "token-3"),
        )
        .unwrap();
        std::thread::sleep(super::creds::FORCED_GAP);
        assert_eq!(c.get("x").unwrap().as_deref(), Some(&b"frame"[..]));

        // Keys from the environment cannot change: their refusal is final.
        let (endpoint, none) = (s3.endpoint(), scratch.join("none").display().to_string());
        let env = move |k: &str| match k {
            "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
            "AWS_ACCESS_KEY_ID" => Some("GMUNKNOWNKEY5".into()),
            "AWS_SECRET_ACCESS_KEY" => Some(SECRET_KEY.into()),
            "AWS_SHARED_CREDENTIALS_FILE" | "AWS_CONFIG_FILE" => Some(none.clone()),
            _ => None,
        };
        let e = Client::connect_with("snaps", &env)
            .unwrap()
            .get("x")
            .unwrap_err();
        assert!(!e.is_transient(), "{e}");

        // A set a request header cannot carry (a file read while being written) is not
        // taken: the last good one signs on.
        std::fs::write(&creds, write("GMROTATEDKEY3", "gm-rotated\0\0", "token-3")).unwrap();
        std::thread::sleep(super::creds::RECHECK + std::time::Duration::from_millis(100));
        assert_eq!(c.get("x").unwrap().as_deref(), Some(&b"frame"[..]));
    }

    /// With no key in the environment or the profile, the variables of the providers that
    /// fetch their own reach object_store (whose `AmazonS3Builder::new` reads none).
    #[test]
    fn a_web_identity_or_a_containers_credentials_are_configured_from_the_environment() {
        use object_store::aws::AmazonS3ConfigKey as K;
        let env = |k: &str| match k {
            "AWS_WEB_IDENTITY_TOKEN_FILE" => Some("/var/run/token".to_string()),
            "AWS_ROLE_ARN" => Some("arn:aws:iam::1:role/gm".to_string()),
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI" => Some("/v2/creds".to_string()),
            "AWS_EC2_METADATA_SERVICE_ENDPOINT" => Some("http://[fd00:ec2::254]".to_string()),
            "AWS_SHARED_CREDENTIALS_FILE" | "AWS_CONFIG_FILE" => Some("/nonexistent".to_string()),
            _ => None,
        };
        let c = Client::connect_with("b", &env).unwrap();
        let b = c.lane_from.as_ref().unwrap();
        assert_eq!(
            b.get_config_value(&K::WebIdentityTokenFile).as_deref(),
            Some("/var/run/token")
        );
        assert_eq!(
            b.get_config_value(&K::RoleArn).as_deref(),
            Some("arn:aws:iam::1:role/gm")
        );
        assert_eq!(
            b.get_config_value(&K::ContainerCredentialsRelativeUri)
                .as_deref(),
            Some("/v2/creds")
        );
        assert_eq!(
            b.get_config_value(&K::MetadataEndpoint).as_deref(),
            Some("http://[fd00:ec2::254]")
        );
        assert_eq!(b.get_config_value(&K::AccessKeyId), None);
    }

    /// A provider given by halves is refused, naming what is missing, where object_store
    /// would ask the instance's metadata service instead; one whose metadata service is
    /// off is refused with no source left.
    #[test]
    fn a_half_given_provider_is_refused_naming_the_missing_variable() {
        let refused = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .chain([(
                    "AWS_SHARED_CREDENTIALS_FILE".to_string(),
                    "/nonexistent".to_string(),
                )])
                .chain([("AWS_CONFIG_FILE".to_string(), "/nonexistent".to_string())])
                .collect();
            let env = move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            match Client::connect_with("b", &env) {
                Ok(_) => String::new(),
                Err(e) => e.to_string(),
            }
        };
        let e = refused(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/token")]);
        assert!(
            e.contains("without AWS_ROLE_ARN") && e.contains("bucket b"),
            "{e}"
        );
        let e = refused(&[("AWS_ROLE_ARN", "arn:aws:iam::1:role/gm")]);
        assert!(e.contains("without AWS_WEB_IDENTITY_TOKEN_FILE"), "{e}");
        let full = (
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "http://169.254.170.23/v1/credentials",
        );
        let e = refused(&[full]);
        assert!(e.contains("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"), "{e}");
        let e = refused(&[full, ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "gmtoken123")]);
        assert!(
            e.contains("only from a file") && !e.contains("gmtoken123"),
            "{e}"
        );
        let e = refused(&[("AWS_EC2_METADATA_DISABLED", "true")]);
        assert!(e.contains("no credentials"), "{e}");
        // Complete ones are taken, and the metadata service's endpoint is passed on.
        assert_eq!(
            refused(&[
                full,
                ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "/var/run/t")
            ]),
            ""
        );
        assert_eq!(
            refused(&[
                ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/creds"),
                full,
                ("AWS_EC2_METADATA_DISABLED", "true"),
            ]),
            ""
        );
        // A stray role past a complete container provider is skipped, as the SDKs do.
        assert_eq!(
            refused(&[
                ("AWS_ROLE_ARN", "arn:aws:iam::1:role/gm"),
                ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/creds"),
            ]),
            ""
        );
    }

    /// A user and password in the endpoint's URL are secrets: left out of the endpoint
    /// shown, and redacted from any text the client lets out.
    #[test]
    fn an_endpoints_password_is_never_shown() {
        let get = |k: &str| match k {
            "AWS_ENDPOINT_URL" => Some("http://gmuser:gmpass1234@127.0.0.1:9/".to_string()),
            "AWS_ACCESS_KEY_ID" => Some("GMKEYID0".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("gmsecret0".to_string()),
            _ => None,
        };
        let c = Client::connect_with("b", &get).unwrap();
        assert_eq!(c.endpoint(), "http://127.0.0.1:9/");
        let said = c.redact(
            "GET http://gmuser:gmpass1234@127.0.0.1:9/b/x failed; password gmpass1234".into(),
        );
        assert!(
            !said.contains("gmpass1234") && !said.contains("gmuser:"),
            "{said}"
        );
    }
}
