//! The PD wire format under random and hostile input: valid messages round-trip; random
//! bytes, mutated, truncated and extended frames are refused with a typed error (never a
//! panic, never an allocation driven by a hostile count); a byte stream with garbage and
//! corrupt frames between valid ones yields every valid frame, in order.

use proptest::prelude::*;
use sparsekit_host::cache::{BufferKind, PageRef};
use sparsekit_server::pd::wire::{
    decode_frame, Arithmetic, Bootstrap, FrameReader, Hello, Message, Role, WireError, Written,
    HEADER_LEN, MAGIC, MAX_REASON,
};

fn page() -> impl Strategy<Value = PageRef> {
    (any::<u32>(), any::<u32>()).prop_map(|(id, generation)| PageRef { id, generation })
}

fn reason() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[a-zA-Z0-9 ]{0,40}", "\\PC{0,20}",]
        .prop_filter("fits", |s: &String| s.len() <= MAX_REASON)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<bool>(),
            (any::<u64>(), any::<u64>(), any::<u64>()),
            1..64u32,
            1..256u32,
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(p, (kv, ik, sf), l, ps, lp, t)| Message::Hello(Hello {
                role: if p { Role::Prefill } else { Role::Decode },
                kv_fingerprint: kv,
                index_k_fingerprint: ik,
                spec_fingerprint: sf,
                num_layers: l,
                page_size: ps,
                arithmetic: if lp % 2 == 0 {
                    Arithmetic::Shared
                } else {
                    Arithmetic::AmxTiles
                },
                landing_pages: lp,
                transport: t,
            })),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u32>(), 1..50),
            proptest::collection::vec(page(), 1..20)
        )
            .prop_map(
                |(req, kv, ik, prompt, pages)| Message::Bootstrap(Bootstrap {
                    req,
                    kv_fingerprint: kv,
                    index_k_fingerprint: ik,
                    prompt,
                    pages,
                })
            ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
            proptest::collection::vec((page(), any::<u64>()), 1..20)
        )
            .prop_map(|(req, layer, kv, fp, pc)| Message::Written(Written {
                req,
                layer,
                kind: if kv {
                    BufferKind::Kv
                } else {
                    BufferKind::IndexK
                },
                fingerprint: fp,
                pages: pc.iter().map(|x| x.0).collect(),
                checksums: pc.iter().map(|x| x.1).collect(),
            })),
        (any::<u64>(), any::<u32>()).prop_map(|(req, tokens)| Message::Finished { req, tokens }),
        (any::<u64>(), reason()).prop_map(|(req, reason)| Message::Cancelled { req, reason }),
        (any::<u64>(), reason()).prop_map(|(req, reason)| Message::Abort { req, reason }),
        prop::collection::vec(any::<u64>(), 1..40).prop_map(|reqs| Message::Pending { reqs }),
    ]
}

fn enc(m: &Message) -> Vec<u8> {
    m.encode().unwrap_or_else(|e| panic!("encode {m:?}: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn valid_messages_round_trip(m in message()) {
        let f = enc(&m);
        prop_assert_eq!(decode_frame(&f), Ok(m));
    }

    /// Random bytes never panic; whatever decodes re-encodes to the same bytes (the
    /// encoding is canonical, so nothing is accepted loosely).
    #[test]
    fn random_bytes_are_refused_or_canonical(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(m) = decode_frame(&bytes) {
            prop_assert_eq!(enc(&m), bytes);
        }
    }

    /// Random bytes behind a valid-looking magic and version reach the header checks.
    #[test]
    fn random_payloads_behind_a_magic_are_refused(tail in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&tail);
        if let Ok(m) = decode_frame(&f) {
            prop_assert_eq!(enc(&m), f);
        }
    }

    /// Flipping any bits of a valid frame is detected (or yields exactly the frame it now
    /// is); truncating it at any point or appending to it is refused.
    #[test]
    fn mutated_frames_are_refused(
        m in message(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1..=255u8), 1..4),
        cut in any::<prop::sample::Index>(),
        extra in proptest::collection::vec(any::<u8>(), 1..8),
    ) {
        let f = enc(&m);
        let mut g = f.clone();
        for (i, x) in &flips {
            let i = i.index(g.len());
            g[i] ^= x;
        }
        match decode_frame(&g) {
            Ok(m2) => prop_assert_eq!(enc(&m2), g),
            Err(e) => prop_assert!(!e.reason().is_empty()),
        }
        let n = cut.index(f.len());
        let e = decode_frame(&f[..n]).expect_err("a truncated frame decoded");
        prop_assert_eq!(e.reason(), "truncated");
        let mut long = f.clone();
        long.extend_from_slice(&extra);
        prop_assert_eq!(decode_frame(&long), Err(WireError::Trailing(extra.len())));
    }

    /// A stream of valid frames with garbage and corrupted frames between them, cut into
    /// random chunks: every valid frame comes out, in order, and each garbage run or bad
    /// frame costs an error, never a valid frame after it.
    #[test]
    fn stream_reader_recovers_every_valid_frame(
        items in proptest::collection::vec(
            (message(), proptest::collection::vec(any::<u8>(), 0..40), any::<bool>()),
            1..12,
        ),
        chunks in proptest::collection::vec(1..64usize, 1..50),
    ) {
        let mut stream = Vec::new();
        let mut want = Vec::new();
        for (m, junk, corrupt_one) in &items {
            // Junk without the magic (a magic inside junk is covered by the corrupt frames).
            let junk: Vec<u8> = junk.iter().map(|&b| if b == MAGIC[0] { 0 } else { b }).collect();
            stream.extend_from_slice(&junk);
            if *corrupt_one {
                let mut bad = enc(m);
                let last = bad.len() - 1;
                bad[last] ^= 0x80; // payload (or header CRC for an empty payload) corrupt
                stream.extend_from_slice(&bad);
            }
            stream.extend_from_slice(&enc(m));
            want.push(m.clone());
        }
        let mut r = FrameReader::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut ci = 0;
        while at < stream.len() {
            let n = chunks[ci % chunks.len()].min(stream.len() - at);
            ci += 1;
            r.push(&stream[at..at + n]);
            at += n;
            while let Some(x) = r.next_frame() {
                if let Ok(m) = x {
                    got.push(m);
                }
            }
        }
        prop_assert_eq!(got, want);
        prop_assert!(r.buffered() < HEADER_LEN);
    }
}

/// Each message kind is accepted only in its direction.
#[test]
fn directions() {
    let w = Message::Written(Written {
        req: 1,
        layer: 0,
        kind: BufferKind::Kv,
        fingerprint: 0,
        pages: vec![PageRef {
            id: 0,
            generation: 0,
        }],
        checksums: vec![0],
    });
    assert!(w.valid_towards(Role::Decode) && !w.valid_towards(Role::Prefill));
    let a = Message::Abort {
        req: 1,
        reason: String::new(),
    };
    assert!(a.valid_towards(Role::Decode) && a.valid_towards(Role::Prefill));
    let f = Message::Finished { req: 1, tokens: 3 };
    assert!(!f.valid_towards(Role::Prefill));
}

/// `Pending` goes prefill → decode only, names no single request, and is never empty.
#[test]
fn pending_heartbeats() {
    let p = Message::Pending { reqs: vec![3, 9] };
    assert!(p.valid_towards(Role::Decode) && !p.valid_towards(Role::Prefill));
    assert_eq!(p.request(), None);
    assert_eq!(decode_frame(&p.encode().unwrap()).unwrap(), p);
    assert!(Message::Pending { reqs: vec![] }.encode().is_err());
    // A frame that says one request but carries none is refused, not decoded as empty.
    let mut f = Message::Pending { reqs: vec![7] }.encode().unwrap();
    f.truncate(f.len() - 8);
    assert!(decode_frame(&f).is_err());
}
