"""Whisper's log-mel features in numpy, as openai-whisper and faster-whisper compute them: a
periodic Hann window of n_fft samples, hop `hop` samples, power spectrum, Slaney mel filters,
log10 clipped 8 below the maximum, scaled to about [-1, 1]. One window of audio (at most
`chunk` seconds) -> [n_mels, chunk * rate / hop], its features padded with zeros."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class FeatureSpec:
    sample_rate: int = 16000
    n_mels: int = 80
    hop: int = 160
    n_fft: int = 400
    chunk_seconds: int = 30

    @property
    def chunk_samples(self) -> int:
        return self.chunk_seconds * self.sample_rate

    @property
    def frames(self) -> int:
        return self.chunk_samples // self.hop


@lru_cache(maxsize=4)
def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Slaney-style mel filter bank (librosa's default, as Whisper uses) -> [n_mels, n_fft // 2 + 1]."""
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    mels = np.linspace(0.0, 45.245640471924965, n_mels + 2)     # mel(0 Hz) .. mel(8 kHz)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    freqs = f_sp * mels
    log_t = mels >= min_log_mel
    freqs[log_t] = min_log_hz * np.exp(logstep * (mels[log_t] - min_log_mel))
    fdiff = np.diff(freqs)
    ramps = freqs.reshape(-1, 1) - fftfreqs.reshape(1, -1)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (freqs[2:n_mels + 2] - freqs[:n_mels]))[:, None]
    return weights.astype(np.float32)


def log_mel(samples: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """One window's samples (float32 [n], n <= chunk_samples) -> features [n_mels, frames] float32:
    the features of the samples themselves, padded with zero features to `frames` (as
    faster-whisper pads them; the maximum the log is clipped under is the window's own)."""
    n = min(samples.size, spec.chunk_samples)
    audio = np.zeros(n + spec.hop, np.float32)      # + hop: the padding Whisper adds
    audio[:n] = samples[:n]
    pad = spec.n_fft // 2
    audio = np.pad(audio, (pad, pad), mode="reflect")
    n_frames = 1 + (audio.size - spec.n_fft) // spec.hop
    frames = np.lib.stride_tricks.as_strided(audio, (n_frames, spec.n_fft), (spec.hop * 4, 4))
    window = np.hanning(spec.n_fft + 1)[:-1].astype(np.float32)
    stft = np.fft.rfft(frames * window, n=spec.n_fft, axis=-1).astype(np.complex64)   # [frames+1, bins]
    power = np.abs(stft[:-1].T) ** 2                                                    # [bins, frames]
    mel = mel_filters(spec.sample_rate, spec.n_fft, spec.n_mels) @ power
    log_spec = np.log10(np.clip(mel, 1e-10, None))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    out = np.zeros((spec.n_mels, spec.frames), np.float32)
    k = min(spec.frames, log_spec.shape[1] - 1)     # the last frame dropped, as faster-whisper drops it
    out[:, :k] = (log_spec[:, :k] + 4.0) / 4.0
    return out


def batch_features(windows: list[np.ndarray], spec: FeatureSpec) -> np.ndarray:
    """Windows' samples -> [batch, n_mels, frames] (what ctranslate2's Whisper.generate takes)."""
    return np.stack([log_mel(w, spec) for w in windows])
