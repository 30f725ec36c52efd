//! The codec of every troupe.v1 client and server: prost's, except that a message that does
//! not decode (bad protobuf, a string that is not UTF-8) is `INVALID_ARGUMENT`, the sender's
//! mistake, where prost's codec says `INTERNAL` and so blames the receiver.

use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// [`ProstCodec`] with malformed messages refused as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct Codec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(ProstCodec::<T, U>::default().decoder())
    }
}

/// [`ProstDecoder`], refusing what does not decode as `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct CheckedDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            Status::invalid_argument(format!("malformed message: {}", status.message()))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
