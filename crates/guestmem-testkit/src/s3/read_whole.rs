//! s3s-fs with a GET read in one blocking read, on the thread that answers it (see the
//! parent module's docs); every other operation is s3s-fs's.

use std::path::PathBuf;

use s3s::dto::*;
use s3s::stream::{ByteStream, RemainingLength};
use s3s::{S3Request, S3Response, S3Result, S3};

use super::Seen;

/// A GET body at most this long is read in one piece; a longer one is left to s3s-fs's stream
/// (memory bounded per request).
const READ_WHOLE_MAX: u64 = 16 << 20;

/// s3s-fs, with a GET read in one blocking read (see the module docs). Every other operation
/// is s3s-fs's.
pub(super) struct ReadWhole {
    fs: s3s_fs::FileSystem,
    root: PathBuf,
    /// The ETag s3s-fs gave each object it stored through a plain PUT (no metadata, no
    /// checksum: nothing else a GET would answer), with its file as it was then.
    etags: std::sync::Mutex<std::collections::HashMap<PathBuf, Stored>>,
    /// Writes of one key (by a hash of its path) one at a time, each with its look at the
    /// file after: an ETag is never kept beside another write's file.
    writes: [tokio::sync::Mutex<()>; 64],
    seen: std::sync::Arc<Seen>,
}

impl ReadWhole {
    /// s3s-fs over `root`, counting in `seen`.
    pub(super) fn new(root: PathBuf, seen: std::sync::Arc<Seen>) -> ReadWhole {
        ReadWhole {
            fs: s3s_fs::FileSystem::new(&root).expect("s3s-fs over the folder"),
            root,
            etags: Default::default(),
            writes: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
            seen,
        }
    }
}

/// What a plain PUT left.
struct Stored {
    etag: ETag,
    file: FileId,
}

/// A file as written: s3s-fs writes every object to a new file and renames it into place,
/// so any later write makes another.
#[derive(PartialEq, Eq, Clone, Copy)]
struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileId {
    fn of(m: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// A body that is one buffer, its length known (`Content-Length`, as s3s-fs sends).
struct OneBuffer(Option<bytes::Bytes>);

impl futures::Stream for OneBuffer {
    type Item = Result<bytes::Bytes, s3s::StdError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::Poll::Ready(self.0.take().map(Ok))
    }
}

impl ByteStream for OneBuffer {
    fn remaining_length(&self) -> RemainingLength {
        RemainingLength::new_exact(self.0.as_ref().map_or(0, |b| b.len()))
    }
}

/// Where a GET's body starts in its object: 0, or the first byte of its `Content-Range`
/// (`bytes FIRST-LAST/TOTAL`), as s3s-fs wrote it.
fn body_start(range: Option<&str>) -> Option<u64> {
    match range {
        None => Some(0),
        Some(r) => r.strip_prefix("bytes ")?.split('-').next()?.parse().ok(),
    }
}

/// `file`'s bytes `range`, read in one read on the thread that asked: a page-cache read of a
/// frame (tens of microseconds) costs less than the two hand-offs to a blocking thread and
/// back, each a wake-up of another thread (on this project's host a wake-up across CPUs
/// costs the waker up to a quarter of a millisecond). Into a buffer not zeroed first.
async fn read_range(file: std::fs::File, range: std::ops::Range<u64>) -> S3Result<StreamingBlob> {
    use std::io::{Read, Seek, SeekFrom};
    let read = move || -> std::io::Result<Vec<u8>> {
        let len = (range.end - range.start) as usize;
        let mut file = file;
        file.seek(SeekFrom::Start(range.start))?;
        let mut buf = Vec::with_capacity(len);
        file.take(len as u64).read_to_end(&mut buf)?;
        if buf.len() != len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(buf)
    };
    let buf = read().map_err(s3s::S3Error::internal_error)?;
    Ok(StreamingBlob::new(OneBuffer(Some(buf.into()))))
}

/// Whether a PUT stored nothing a GET answers but the bytes and their ETag.
fn plain_put(i: &PutObjectInput) -> bool {
    i.metadata.is_none()
        && i.content_type.is_none()
        && i.content_encoding.is_none()
        && i.content_disposition.is_none()
        && i.content_language.is_none()
        && i.cache_control.is_none()
        && i.expires.is_none()
        && i.website_redirect_location.is_none()
        && i.checksum_algorithm.is_none()
        && i.checksum_crc32.is_none()
        && i.checksum_crc32c.is_none()
        && i.checksum_crc64nvme.is_none()
        && i.checksum_sha1.is_none()
        && i.checksum_sha256.is_none()
}

/// Whether a GET asks for nothing but bytes (and a range of them).
fn plain_get(i: &GetObjectInput) -> bool {
    i.checksum_mode.is_none()
        && i.if_match.is_none()
        && i.if_modified_since.is_none()
        && i.if_none_match.is_none()
        && i.if_unmodified_since.is_none()
        && i.part_number.is_none()
        && i.response_cache_control.is_none()
        && i.response_content_disposition.is_none()
        && i.response_content_encoding.is_none()
        && i.response_content_language.is_none()
        && i.response_content_type.is_none()
        && i.response_expires.is_none()
}

impl ReadWhole {
    /// The file of a key that names it plainly (s3s-fs resolves `..` within its root; such a
    /// key is left to it).
    fn path(&self, bucket: &str, key: &str) -> Option<PathBuf> {
        let plain = |k: &str| !k.starts_with('/') && !k.split('/').any(|c| c == "..");
        (plain(bucket) && plain(key)).then(|| self.root.join(bucket).join(key))
    }

    /// The lock of writes to `bucket`/`key`.
    fn writes_of(&self, bucket: &str, key: &str) -> &tokio::sync::Mutex<()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (bucket, key).hash(&mut h);
        &self.writes[h.finish() as usize % self.writes.len()]
    }

    async fn put(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        let (bucket, key) = (req.input.bucket.clone(), req.input.key.clone());
        let _one = self.writes_of(&bucket, &key).lock().await;
        let path = self.path(&bucket, &key);
        let plain = plain_put(&req.input);
        let resp = self.fs.put_object(req).await;
        let Some(path) = path else { return resp };
        let mut etags = self.etags.lock().expect("etags");
        etags.remove(&path);
        if let (true, Ok(r), Ok(m)) = (plain, &resp, std::fs::metadata(&path)) {
            if let Some(etag) = &r.output.e_tag {
                let file = FileId::of(&m);
                etags.insert(
                    path,
                    Stored {
                        etag: etag.clone(),
                        file,
                    },
                );
            }
        }
        resp
    }

    async fn get(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        if let Some(log) = self.seen.gets.lock().expect("the GET log").as_mut() {
            log.push(req.input.key.clone());
        }
        let us = self
            .seen
            .get_delay_us
            .load(std::sync::atomic::Ordering::Relaxed);
        if us > 0 {
            tokio::time::sleep(std::time::Duration::from_micros(us)).await;
        }
        let path = self.path(&req.input.bucket, &req.input.key);
        if let Some(path) = path.as_ref().filter(|_| plain_get(&req.input)) {
            // An object stored by a plain PUT, its file the one that PUT left: answered as
            // s3s-fs would, without reading it twice (s3s-fs reads it all for its MD5 on
            // every GET). Checked and read through one descriptor.
            let file = std::fs::File::open(path).ok();
            let known = file.as_ref().and_then(|f| {
                let id = FileId::of(&f.metadata().ok()?);
                let etags = self.etags.lock().expect("etags");
                let s = etags.get(path).filter(|s| s.file == id)?;
                Some((s.etag.clone(), id.len, f.metadata().ok()?.modified().ok()?))
            });
            let range = |len| match &req.input.range {
                None => Some((0..len, None)),
                Some(r) => {
                    let r = r.check(len).ok()?;
                    let cr = format!("bytes {}-{}/{len}", r.start, r.end - 1);
                    Some((r, Some(cr)))
                }
            };
            if let (Some(file), Some((etag, len, modified))) = (file, known) {
                if let Some((r, content_range)) =
                    range(len).filter(|(r, _)| r.end - r.start <= READ_WHOLE_MAX)
                {
                    let output = GetObjectOutput {
                        content_length: Some((r.end - r.start) as i64),
                        body: Some(read_range(file, r).await?),
                        content_range,
                        last_modified: Some(Timestamp::from(modified)),
                        e_tag: Some(etag),
                        ..Default::default()
                    };
                    return Ok(S3Response::new(output));
                }
            }
        }
        // s3s-fs answers; only its body is replaced (read through the file it opened's
        // path again, checked to be the same file).
        let mut resp = self.fs.get_object(req).await?;
        let out = &mut resp.output;
        if let (Some(path), Some(len), Some(start)) = (
            path,
            out.content_length
                .and_then(|l| u64::try_from(l).ok())
                .filter(|&l| l <= READ_WHOLE_MAX),
            body_start(out.content_range.as_deref()),
        ) {
            let same = |f: &std::fs::File| {
                let t = f.metadata().ok()?.modified().ok()?;
                (Some(Timestamp::from(t)) == out.last_modified).then_some(())
            };
            if let Some(f) = std::fs::File::open(&path)
                .ok()
                .filter(|f| same(f).is_some())
            {
                out.body = Some(read_range(f, start..start + len).await?);
            }
        }
        Ok(resp)
    }

    /// A write of `bucket`/`key` by s3s-fs (`op`, not started yet): alone among that key's
    /// writes, its ETag forgotten first.
    async fn write<T>(
        &self,
        bucket: &str,
        key: &str,
        op: impl std::future::Future<Output = T>,
    ) -> T {
        let _one = self.writes_of(bucket, key).lock().await;
        self.forget(bucket, key);
        op.await
    }

    async fn delete_many(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let bucket = req.input.bucket.clone();
        for o in &req.input.delete.objects {
            self.forget(&bucket, &o.key);
        }
        self.fs.delete_objects(req).await
    }

    /// An object about to be written or deleted: its ETag no longer known.
    fn forget(&self, bucket: &str, key: &str) {
        if let Some(p) = self.path(bucket, key) {
            self.etags.lock().expect("etags").remove(&p);
        }
    }
}

/// `impl S3 for ReadWhole`: reads and writes as above (each write forgets the ETag kept for
/// its key), HEADs delayed as a test asks, every other operation s3s-fs implements passed
/// to it as it is.
macro_rules! s3_passing_to_s3s_fs {
    ($($op:ident($input:ty) -> $output:ty;)*) => {
        #[async_trait::async_trait]
        impl S3 for ReadWhole {
            async fn get_object(
                &self,
                req: S3Request<GetObjectInput>,
            ) -> S3Result<S3Response<GetObjectOutput>> {
                self.get(req).await
            }
            async fn put_object(
                &self,
                req: S3Request<PutObjectInput>,
            ) -> S3Result<S3Response<PutObjectOutput>> {
                self.put(req).await
            }
            async fn copy_object(
                &self,
                req: S3Request<CopyObjectInput>,
            ) -> S3Result<S3Response<CopyObjectOutput>> {
                let (b, k) = (req.input.bucket.clone(), req.input.key.clone());
                self.write(&b, &k, self.fs.copy_object(req)).await
            }
            async fn complete_multipart_upload(
                &self,
                req: S3Request<CompleteMultipartUploadInput>,
            ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
                let (b, k) = (req.input.bucket.clone(), req.input.key.clone());
                self.write(&b, &k, self.fs.complete_multipart_upload(req)).await
            }
            async fn delete_object(
                &self,
                req: S3Request<DeleteObjectInput>,
            ) -> S3Result<S3Response<DeleteObjectOutput>> {
                let (b, k) = (req.input.bucket.clone(), req.input.key.clone());
                self.write(&b, &k, self.fs.delete_object(req)).await
            }
            async fn delete_objects(
                &self,
                req: S3Request<DeleteObjectsInput>,
            ) -> S3Result<S3Response<DeleteObjectsOutput>> {
                self.delete_many(req).await
            }
            async fn head_object(
                &self,
                req: S3Request<HeadObjectInput>,
            ) -> S3Result<S3Response<HeadObjectOutput>> {
                let us = self.seen.head_delay_us.load(std::sync::atomic::Ordering::Relaxed);
                if us > 0 {
                    tokio::time::sleep(std::time::Duration::from_micros(us)).await;
                }
                self.fs.head_object(req).await
            }
            $(
                async fn $op(&self, req: S3Request<$input>) -> S3Result<S3Response<$output>> {
                    self.fs.$op(req).await
                }
            )*
        }
    };
}

s3_passing_to_s3s_fs! {
    create_bucket(CreateBucketInput) -> CreateBucketOutput;
    delete_bucket(DeleteBucketInput) -> DeleteBucketOutput;
    get_bucket_location(GetBucketLocationInput) -> GetBucketLocationOutput;
    head_bucket(HeadBucketInput) -> HeadBucketOutput;
    list_buckets(ListBucketsInput) -> ListBucketsOutput;
    list_objects(ListObjectsInput) -> ListObjectsOutput;
    list_objects_v2(ListObjectsV2Input) -> ListObjectsV2Output;
    create_multipart_upload(CreateMultipartUploadInput) -> CreateMultipartUploadOutput;
    upload_part(UploadPartInput) -> UploadPartOutput;
    upload_part_copy(UploadPartCopyInput) -> UploadPartCopyOutput;
    list_parts(ListPartsInput) -> ListPartsOutput;
    abort_multipart_upload(AbortMultipartUploadInput) -> AbortMultipartUploadOutput;
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_body_starts_where_its_content_range_says() {
        assert_eq!(super::body_start(None), Some(0));
        assert_eq!(super::body_start(Some("bytes 100-199/1000")), Some(100));
        assert_eq!(super::body_start(Some("bytes */1000")), None);
    }
}
