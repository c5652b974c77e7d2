//! What workers say to each other in the peer cache tier: a worker asks the
//! owner of some samples for their bytes, and the owner answers with what
//! it holds.
//!
//! One exchange is one QUIC bidirectional stream with one [`PeerRequest`]
//! frame and one [`PeerReply`] frame, framed and validated like the
//! worker–server protocol (see [`crate::protocol`]): a 4-byte length and an
//! rkyv archive checked with bytecheck before anything reads it.
//!
//! The request names the dataset by its manifest's checksum and size, so a
//! worker of another job (or one reading another version of the dataset)
//! is refused rather than served the wrong bytes. The reply carries, for each
//! sample asked, its bytes or nothing (not held); the asker checks every
//! record against the manifest's checksum of that sample before using it.
//!
//! ```
//! use ps_net::peer::{decode_peer_reply, decode_peer_request, encode_peer_reply,
//!     encode_peer_request, PeerReply, PeerRequest};
//! let req = PeerRequest { dataset_crc32: 7, dataset_bytes: 99, samples: vec![3, 5] };
//! let frame = encode_peer_request(&req).unwrap().to_vec();
//! assert_eq!(decode_peer_request(&frame[4..]).unwrap(), req);
//! let reply = PeerReply::Records(vec![Some(vec![1, 2]), None]);
//! let frame = encode_peer_reply(&reply).unwrap().to_vec();
//! assert_eq!(decode_peer_reply(&frame[4..]).unwrap(), reply);
//! assert!(decode_peer_reply(&[9, 9, 9]).is_err());
//! ```

use rkyv::{Archive, Deserialize, Serialize};

use crate::protocol::{decode, encode_with, EncodedFrame, ProtocolError};

/// Largest request frame an owner reads.
pub const MAX_PEER_REQUEST_BYTES: usize = 64 << 10;

pub use ps_shared::config::MAX_PEER_SAMPLES;

/// One worker asks another for the bytes of some training samples.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PeerRequest {
    /// CRC-32 of the dataset's manifest (the asker's copy).
    pub dataset_crc32: u32,
    /// Length of the manifest in bytes.
    pub dataset_bytes: u64,
    /// Indices in the training split.
    pub samples: Vec<u64>,
}

/// The owner's answer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum PeerReply {
    /// One entry per sample asked, in order: its bytes, or `None` when the
    /// owner does not hold it (the asker reads the bucket).
    Records(Vec<Option<Vec<u8>>>),
    /// The request was refused as a whole (another dataset, too many
    /// samples, the owner is not serving): the asker reads the bucket.
    Refused(String),
}

impl PeerReply {
    /// Bytes of sample data it carries.
    pub fn data_bytes(&self) -> usize {
        match self {
            PeerReply::Records(r) => r.iter().flatten().map(Vec::len).sum(),
            PeerReply::Refused(_) => 0,
        }
    }
}

pub fn encode_peer_request(req: &PeerRequest) -> Result<EncodedFrame, ProtocolError> {
    encode_with(req, 8 * req.samples.len())
}

pub fn encode_peer_reply(reply: &PeerReply) -> Result<EncodedFrame, ProtocolError> {
    let records = match reply {
        PeerReply::Records(r) => 16 * r.len(),
        PeerReply::Refused(m) => m.len(),
    };
    encode_with(reply, reply.data_bytes() + records)
}

/// Validate and decode a request payload (the bytes after the length prefix).
pub fn decode_peer_request(payload: &[u8]) -> Result<PeerRequest, ProtocolError> {
    decode(payload)
}

/// Validate and decode a reply payload (the bytes after the length prefix).
pub fn decode_peer_reply(payload: &[u8]) -> Result<PeerReply, ProtocolError> {
    decode(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_frames_are_errors_not_panics() {
        let reply = PeerReply::Records(vec![Some(vec![7; 100]), None, Some(vec![])]);
        let frame = encode_peer_reply(&reply).unwrap().to_vec();
        let payload = &frame[4..];
        assert_eq!(decode_peer_reply(payload).unwrap(), reply);
        for cut in [0, 1, payload.len() / 2, payload.len() - 1] {
            assert!(decode_peer_reply(&payload[..cut]).is_err(), "cut at {cut}");
        }
        let req = PeerRequest {
            dataset_crc32: 1,
            dataset_bytes: 2,
            samples: (0..10).collect(),
        };
        let frame = encode_peer_request(&req).unwrap().to_vec();
        let mut bad = frame[4..].to_vec();
        let n = bad.len();
        bad[n - 1] ^= 0xff;
        // A flipped byte either fails validation or decodes to another
        // request; it never panics.
        let _ = decode_peer_request(&bad);
    }
}
