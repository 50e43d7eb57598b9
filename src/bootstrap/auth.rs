//! Mutual challenge/response that every bootstrap and transport connection starts with.
//!
//! Both sides hold the communicator's 32-byte secret. The client says what the connection is for
//! (`context`) and sends a fresh nonce; the server answers with its own nonce and an HMAC-SHA256 proof
//! over both nonces and the context; the client checks it and answers with its proof; the server
//! checks that and acknowledges. Fresh nonces on both sides make a recorded exchange useless, distinct
//! labels for the two proofs stop a server's proof from being reflected as a client's, and binding
//! the context means a connection authenticated for one purpose (rank 3 -> rank 4 of communicator X)
//! cannot be passed off as another.
//!
//! Wire format (all sizes fixed except the context):
//! ```text
//! client -> server  "COMMAUTH" | version u16 | context length u16 | client nonce [32] | context
//! server -> client  status u8; when OK: server nonce [32] | server proof [32]
//! client -> server  verdict u8 | client proof [32]
//! server -> client  status u8
//! ```
//! Each side reads exactly the bytes of the handshake and nothing beyond, so the stream can carry
//! other traffic (file descriptors, frames) right after.

use std::io::{Read, Write};
use std::net::TcpStream;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::net::{self, Waiter};
use crate::error::{Error, ErrorKind, Result};

/// Longest context a client may send; the server refuses more without reading it.
pub(crate) const MAX_CONTEXT: usize = 1024;

const MAGIC: &[u8; 8] = b"COMMAUTH";
const VERSION: u16 = 1;
const HELLO_HEAD: usize = 8 + 2 + 2 + 32;
const PROOF_MSG: usize = 1 + 32;

const OK: u8 = 1;
const REFUSED: u8 = 2;
const BAD_VERSION: u8 = 3;
const BAD_PROOF: u8 = 4;

const SERVER_LABEL: &[u8] = b"comm-auth-v1 server proof";
const CLIENT_LABEL: &[u8] = b"comm-auth-v1 client proof";

/// Authenticates the client end of `s` (blocking; bound the wait with the stream's own read timeout).
/// Returns Err, and logs a WARN, on any mismatch, garbage or I/O failure.
pub(crate) fn client<S: Read + Write>(s: &mut S, secret: &[u8; 32], context: &[u8]) -> Result<()> {
    client_on(&mut IoWire(s), secret, context)
}

/// Authenticates the server end of `s`: the client must know `secret` and ask for exactly `context`.
pub(crate) fn server<S: Read + Write>(s: &mut S, secret: &[u8; 32], context: &[u8]) -> Result<()> {
    let lookup = |ctx: &[u8]| -> std::result::Result<[u8; 32], String> {
        if ctx == context {
            Ok(*secret)
        } else {
            Err("the connection is meant for another purpose or peer (context mismatch)".into())
        }
    };
    let mut wire = IoWire(s);
    let mut hs = ServerHandshake::new();
    let outcome = (|| -> Result<()> {
        loop {
            let mut msg = vec![0u8; hs.need()];
            wire.recv_exact(&mut msg)?;
            match hs.on_message(&msg, &lookup) {
                Step::Reply(r) => wire.send_all(&r)?,
                Step::Done(r) => return wire.send_all(&r),
                Step::Refuse(r, why) => {
                    let _ = wire.send_all(&r);
                    return crate::remote_err!("{why}");
                }
            }
        }
    })();
    outcome.map_err(|e| {
        crate::warn!("refused an incoming connection: {}", e.msg);
        e.context("authenticating an incoming connection")
    })
}

/// HMAC-SHA256 of the concatenated `parts`, keyed by `key`.
pub(crate) fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = new_mac(key);
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

fn new_mac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail.
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length")
}

fn proof_mac(
    label: &[u8],
    secret: &[u8; 32],
    cnonce: &[u8],
    snonce: &[u8],
    ctx: &[u8],
) -> Hmac<Sha256> {
    let mut mac = new_mac(secret);
    for part in [
        label,
        cnonce,
        snonce,
        &(ctx.len() as u16).to_le_bytes()[..],
        ctx,
    ] {
        mac.update(part);
    }
    mac
}

fn proof(label: &[u8], secret: &[u8; 32], cnonce: &[u8], snonce: &[u8], ctx: &[u8]) -> [u8; 32] {
    proof_mac(label, secret, cnonce, snonce, ctx)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time comparison, so response timing reveals nothing about the expected proof.
fn proof_matches(
    label: &[u8],
    secret: &[u8; 32],
    cnonce: &[u8],
    snonce: &[u8],
    ctx: &[u8],
    got: &[u8],
) -> bool {
    proof_mac(label, secret, cnonce, snonce, ctx)
        .verify_slice(got)
        .is_ok()
}

pub(crate) fn random32() -> Result<[u8; 32]> {
    let mut b = [0u8; 32];
    getrandom::getrandom(&mut b)
        .map_err(|e| Error::new(ErrorKind::System, format!("getrandom: {e}")))?;
    Ok(b)
}

/// Byte transport for the blocking side of a handshake.
pub(crate) trait Wire {
    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<()>;
    fn send_all(&mut self, buf: &[u8]) -> Result<()>;
    fn peer(&self) -> Option<String>;
}

struct IoWire<'a, S>(&'a mut S);

impl<S: Read + Write> Wire for IoWire<'_, S> {
    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        self.0
            .read_exact(buf)
            .map_err(|e| Error::from_io("authentication handshake", e))
    }
    fn send_all(&mut self, buf: &[u8]) -> Result<()> {
        self.0
            .write_all(buf)
            .and_then(|_| self.0.flush())
            .map_err(|e| Error::from_io("authentication handshake", e))
    }
    fn peer(&self) -> Option<String> {
        None
    }
}

/// A non-blocking TCP stream driven with poll, honouring a deadline and the abort flag.
pub(crate) struct TcpWire<'a> {
    pub stream: &'a TcpStream,
    pub waiter: Waiter<'a>,
    pub peer: &'a str,
}

impl Wire for TcpWire<'_> {
    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        net::read_exact(self.stream, buf, self.waiter, self.peer)
    }
    fn send_all(&mut self, buf: &[u8]) -> Result<()> {
        net::write_all(self.stream, buf, self.waiter, self.peer)
    }
    fn peer(&self) -> Option<String> {
        Some(self.peer.to_string())
    }
}

/// The client side over any wire; logs a WARN naming the peer when it fails.
pub(crate) fn client_on(w: &mut dyn Wire, secret: &[u8; 32], ctx: &[u8]) -> Result<()> {
    let peer = w.peer().unwrap_or_else(|| "the peer".to_string());
    client_steps(w, secret, ctx).map_err(|e| {
        crate::warn!("authentication with {peer} failed: {}", e.msg);
        e.context(format!("authenticating to {peer}"))
    })
}

pub(crate) fn client_steps(w: &mut dyn Wire, secret: &[u8; 32], ctx: &[u8]) -> Result<()> {
    if ctx.len() > MAX_CONTEXT {
        return crate::internal_err!("authentication context of {} bytes is too long", ctx.len());
    }
    let cnonce = random32()?;
    let mut hello = Vec::with_capacity(HELLO_HEAD + ctx.len());
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&(ctx.len() as u16).to_le_bytes());
    hello.extend_from_slice(&cnonce);
    hello.extend_from_slice(ctx);
    w.send_all(&hello)?;

    let mut status = [0u8; 1];
    w.recv_exact(&mut status)?;
    match status[0] {
        OK => {}
        REFUSED => {
            return crate::remote_err!(
            "the server refused: the connection is meant for another communicator, rank or purpose"
        )
        }
        BAD_VERSION => {
            return crate::remote_err!("the server speaks another version of the handshake")
        }
        other => return crate::remote_err!("the server answered with garbage (status {other})"),
    }
    let mut challenge = [0u8; 64];
    w.recv_exact(&mut challenge)?;
    let (snonce, sproof) = challenge.split_at(32);
    if !proof_matches(SERVER_LABEL, secret, &cnonce, snonce, ctx, sproof) {
        // Tell the server why it is dropped; the bytes carry no proof.
        let _ = w.send_all(&[0u8; PROOF_MSG]);
        return crate::remote_err!(
            "the server does not know this communicator's secret (wrong secret or another job)"
        );
    }
    let mut answer = [0u8; PROOF_MSG];
    answer[0] = OK;
    answer[1..].copy_from_slice(&proof(CLIENT_LABEL, secret, &cnonce, snonce, ctx));
    w.send_all(&answer)?;
    w.recv_exact(&mut status)?;
    match status[0] {
        OK => Ok(()),
        BAD_PROOF => crate::remote_err!("the server rejected this side's proof (different secret)"),
        other => crate::remote_err!("the server answered with garbage (status {other})"),
    }
}

/// Maps the context a client asks for to the secret it must prove, or to why it is refused.
pub(crate) type Lookup<'a> = dyn Fn(&[u8]) -> std::result::Result<[u8; 32], String> + 'a;

/// What the server does after a message.
pub(crate) enum Step {
    /// Send these bytes and wait for the next message.
    Reply(Vec<u8>),
    /// Send these bytes; the peer is authenticated.
    Done(Vec<u8>),
    /// Send these bytes (possibly none) and drop the connection, for this reason.
    Refuse(Vec<u8>, String),
}

enum Stage {
    Hello,
    Context(usize),
    Proof,
    Done,
}

/// The server side as a state machine without I/O, so that a listener can run many handshakes at
/// once from one poll loop and none of them can stall the others.
pub(crate) struct ServerHandshake {
    stage: Stage,
    cnonce: [u8; 32],
    snonce: [u8; 32],
    ctx: Vec<u8>,
    secret: [u8; 32],
}

impl ServerHandshake {
    pub(crate) fn new() -> ServerHandshake {
        ServerHandshake {
            stage: Stage::Hello,
            cnonce: [0; 32],
            snonce: [0; 32],
            ctx: Vec::new(),
            secret: [0; 32],
        }
    }

    /// Exactly how many bytes the next message has.
    pub(crate) fn need(&self) -> usize {
        match self.stage {
            Stage::Hello => HELLO_HEAD,
            Stage::Context(n) => n,
            Stage::Proof => PROOF_MSG,
            Stage::Done => 0,
        }
    }

    /// Why a client whose next message begins with `partial` is refused before the rest comes:
    /// a hello that does not start like one is garbage, however short, so that it is dropped
    /// at once instead of holding a slot until its deadline.
    pub(crate) fn refuses_early(&self, partial: &[u8]) -> Option<String> {
        let n = partial.len().min(MAGIC.len());
        (matches!(self.stage, Stage::Hello) && partial[..n] != MAGIC[..n])
            .then(|| "sent garbage instead of a handshake (bad magic)".to_string())
    }

    /// The context the client asked for; meaningful once the handshake is done.
    pub(crate) fn context(&self) -> &[u8] {
        &self.ctx
    }

    /// Consumes one message of `need()` bytes. `lookup` maps the client's context to the secret it
    /// must prove, or to the reason it is refused.
    pub(crate) fn on_message(&mut self, msg: &[u8], lookup: &Lookup<'_>) -> Step {
        match self.stage {
            Stage::Hello => {
                if &msg[..8] != MAGIC {
                    return Step::Refuse(
                        Vec::new(),
                        "sent garbage instead of a handshake (bad magic)".into(),
                    );
                }
                let version = u16::from_le_bytes([msg[8], msg[9]]);
                if version != VERSION {
                    return Step::Refuse(
                        vec![BAD_VERSION],
                        format!("speaks handshake version {version}, this library {VERSION}"),
                    );
                }
                let len = u16::from_le_bytes([msg[10], msg[11]]) as usize;
                if len > MAX_CONTEXT {
                    return Step::Refuse(
                        vec![REFUSED],
                        format!("announced a context of {len} bytes (at most {MAX_CONTEXT})"),
                    );
                }
                self.cnonce.copy_from_slice(&msg[12..44]);
                if len == 0 {
                    self.challenge(Vec::new(), lookup)
                } else {
                    self.stage = Stage::Context(len);
                    Step::Reply(Vec::new())
                }
            }
            Stage::Context(_) => self.challenge(msg.to_vec(), lookup),
            Stage::Proof => {
                if msg[0] != OK {
                    return Step::Refuse(
                        Vec::new(),
                        "the client found this side's proof wrong (different secret)".into(),
                    );
                }
                let good = proof_matches(
                    CLIENT_LABEL,
                    &self.secret,
                    &self.cnonce,
                    &self.snonce,
                    &self.ctx,
                    &msg[1..],
                );
                if !good {
                    return Step::Refuse(
                        vec![BAD_PROOF],
                        "wrong secret: failed authentication (another job, or a stale unique id)"
                            .into(),
                    );
                }
                self.stage = Stage::Done;
                Step::Done(vec![OK])
            }
            Stage::Done => Step::Refuse(Vec::new(), "handshake already complete".into()),
        }
    }

    fn challenge(&mut self, ctx: Vec<u8>, lookup: &Lookup<'_>) -> Step {
        let secret = match lookup(&ctx) {
            Ok(s) => s,
            Err(why) => return Step::Refuse(vec![REFUSED], why),
        };
        let snonce = match random32() {
            Ok(n) => n,
            Err(e) => return Step::Refuse(Vec::new(), e.msg),
        };
        let mut reply = Vec::with_capacity(65);
        reply.push(OK);
        reply.extend_from_slice(&snonce);
        reply.extend_from_slice(&proof(SERVER_LABEL, &secret, &self.cnonce, &snonce, &ctx));
        self.secret = secret;
        self.snonce = snonce;
        self.ctx = ctx;
        self.stage = Stage::Proof;
        Step::Reply(reply)
    }
}
