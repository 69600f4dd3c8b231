//! TensorBoard event files: what `tensorboard --logdir` and `wandb sync --sync-tensorboard`
//! read. A file is a sequence of records, each a little-endian length, its masked CRC-32C,
//! the bytes of one `Event` protocol buffer and their masked CRC-32C; the first event names
//! the file version.
//!
//! Only the messages a run writes are declared (scalars and PNG images of TensorBoard's
//! `Event` and `Summary`), with their field numbers, so no protobuf compiler is needed:
//! `prost` encodes them and `crc32c` checksums the records.
use crate::{Error, Result};
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "EventBody", tags = "3, 5, 7")]
    body: Option<EventBody>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum EventBody {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// A session's start: readers drop the events of earlier files from its step on, so a
/// resumed run's steps replace those the interrupted run logged past its checkpoint.
#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    /// 1: START.
    #[prost(int32, tag = "1")]
    status: i32,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(oneof = "ValueKind", tags = "2, 4")]
    kind: Option<ValueKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum ValueKind {
    #[prost(float, tag = "2")]
    Scalar(f32),
    #[prost(message, tag = "4")]
    Image(Image),
}

#[derive(Clone, PartialEq, Message)]
struct Image {
    #[prost(int32, tag = "1")]
    height: i32,
    #[prost(int32, tag = "2")]
    width: i32,
    /// 3: RGB, 4: RGBA.
    #[prost(int32, tag = "3")]
    colorspace: i32,
    #[prost(bytes = "vec", tag = "4")]
    encoded_image_string: Vec<u8>,
}

/// The checksum TensorFlow's record format stores: CRC-32C, rotated and offset so that a
/// checksum of data holding checksums does not degenerate.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record of the file format around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// Appends events to one new file in a log folder. Each write reaches the file before it
/// returns, so a run that dies keeps every step it reported.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// A new event file in `dir` (created if needed), named as TensorBoard looks for them,
    /// for a run whose next step is `next_step`. Readers take a folder's files in name order,
    /// so the name's time is later than that of every file already there; a resumed run
    /// (`next_step` > 1) starts with a session start at `next_step`.
    pub fn create(dir: &Path, next_step: u64) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let seconds = now.max(latest_file_time(dir)? + 1);
        let path = dir.join(format!("events.out.tfevents.{seconds}.{}.{}", host_name(), std::process::id()));
        let file =
            std::fs::OpenOptions::new().create_new(true).write(true).open(&path).map_err(|e| Error::io(&path, e))?;
        let mut writer = EventWriter { path, file };
        writer.write(0, EventBody::FileVersion("brain.Event:2".into()))?;
        if next_step > 1 {
            writer.write(next_step, EventBody::SessionLog(SessionLog { status: 1 }))?;
        }
        Ok(writer)
    }

    /// Scalars of one step, by tag.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue { tag: tag.clone(), kind: Some(ValueKind::Scalar(*v as f32)) })
            .collect();
        self.write(step, EventBody::Summary(Summary { value }))
    }

    /// A PNG picture under `tag` at `step`.
    pub fn png(&mut self, step: u64, tag: &str, png: Vec<u8>) -> Result<()> {
        let (width, height, colorspace) =
            png_header(&png).ok_or_else(|| Error::Plot(format!("{tag}: not a PNG image")))?;
        let image = Image { height, width, colorspace, encoded_image_string: png };
        let value = vec![SummaryValue { tag: tag.into(), kind: Some(ValueKind::Image(image)) }];
        self.write(step, EventBody::Summary(Summary { value }))
    }

    fn write(&mut self, step: u64, body: EventBody) -> Result<()> {
        let wall_time =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let event = Event { wall_time, step: step as i64, body: Some(body) };
        self.file.write_all(&record(&event.encode_to_vec())).map_err(|e| Error::io(&self.path, e))?;
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// The largest time in the names of `dir`'s event files (0 where there are none).
fn latest_file_time(dir: &Path) -> Result<u64> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    Ok(entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| name.strip_prefix("events.out.tfevents.")?.split('.').next()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0))
}

/// Width, height and TensorBoard's colour space of a PNG, from its header.
fn png_header(png: &[u8]) -> Option<(i32, i32, i32)> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if png.len() < 26 || &png[..8] != SIGNATURE || &png[12..16] != b"IHDR" {
        return None;
    }
    let word = |at: usize| i32::from_be_bytes([png[at], png[at + 1], png[at + 2], png[at + 3]]);
    // Colour type 6 carries an alpha channel; the pictures Strata draws are RGB otherwise.
    let colorspace = if png[25] == 6 { 4 } else { 3 };
    Some((word(16), word(20), colorspace))
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match rc {
        0 if end > 0 => String::from_utf8_lossy(&buf[..end]).into_owned(),
        _ => "localhost".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TensorFlow's record format over data whose CRC-32C is known: the RFC 3720 check value
    /// of 32 zero bytes (0x8a9136aa), masked.
    #[test]
    fn records_carry_masked_crc32c() {
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(masked_crc(&[0u8; 32]), 0x8a91_36aau32.rotate_right(15).wrapping_add(0xa282_ead8));
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), 3);
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(u32::from_le_bytes(r[15..].try_into().unwrap()), masked_crc(b"abc"));
    }

    #[test]
    fn png_size_read_from_its_header() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend_from_slice(&640u32.to_be_bytes());
        png.extend_from_slice(&480u32.to_be_bytes());
        png.extend_from_slice(&[8, 2, 0, 0, 0]);
        assert_eq!(png_header(&png), Some((640, 480, 3)));
        assert_eq!(png_header(b"GIF89a"), None);
    }
}
