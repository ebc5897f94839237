import { describe, expect, it } from 'vitest';

import { deviceLabel, History, memoryMeter, releasedText, sparklinePath, sparklineSvg, utilizationMeter } from '../src/meters';

describe('History', () => {
  it('keeps the last samples per key, oldest first', () => {
    const history = new History(3);
    for (const value of [1, 2, 3, 4]) {
      history.push('gpu', value);
    }
    history.push('other', null);
    expect(history.get('gpu')).toEqual([2, 3, 4]);
    expect(history.get('other')).toEqual([null]);
    expect(history.get('unknown')).toEqual([]);
  });
});

describe('sparklinePath', () => {
  it('scales to the box, newest at the right edge, a gap for null', () => {
    expect(sparklinePath([0, 50, null, 100], 100, 30, 10)).toBe('M0.0 10.0 L10.0 5.0 M30.0 0.0');
  });
  it('starts at the right while the history is short', () => {
    expect(sparklinePath([100], 100, 30, 10, 4)).toBe('M30.0 0.0');
  });
  it('clamps values outside 0..max and draws nothing when nothing was measured', () => {
    expect(sparklinePath([200, -5], 100, 10, 10)).toBe('M0.0 0.0 L10.0 10.0');
    expect(sparklinePath([null, null], 100, 10, 10)).toBe('');
    expect(sparklineSvg([null], 100, 40)).not.toContain('<path');
  });
});

describe('meters', () => {
  const device = { uuid: 'GPU-1', name: 'A100', memory_mib: 40960 };
  it('say the live use of the GPU from the API', () => {
    const live = { ...device, activity: { gpu_utilization: 35.4, memory_used_mib: 2048 } };
    expect(utilizationMeter(live)).toEqual({ fraction: 0.354, text: 'GPU use 35%' });
    expect(memoryMeter(live)).toEqual({ fraction: 0.05, text: 'Memory 2.0 GiB of 40.0 GiB' });
  });
  it('say when nothing was measured rather than 0', () => {
    const idle = { ...device, activity: { gpu_utilization: null, memory_used_mib: null } };
    expect(utilizationMeter(idle)).toEqual({ fraction: null, text: 'GPU use: not measured' });
    expect(memoryMeter(device).text).toBe('Memory: not measured');
  });
});

describe('releasedText', () => {
  it('gives the total and the trend readably', () => {
    expect(releasedText(0, 0)).toBe('GPU time released by hibernation: none yet · none released now');
    expect(releasedText(0.2, 0.25)).toBe(
      'GPU time released by hibernation: 12 GPU-minutes · 0.25 GPU released now (+15 GPU-minutes per hour)'
    );
    expect(releasedText(3.44, null)).toBe('GPU time released by hibernation: 3.4 GPU-hours');
  });
});

describe('deviceLabel', () => {
  it('numbers GPUs so that identical models are told apart, with their node on Kubernetes', () => {
    expect(deviceLabel({ uuid: 'u0', name: 'NVIDIA H100', index: 0 })).toBe('GPU 0 · NVIDIA H100');
    expect(deviceLabel({ uuid: 'u1', name: 'NVIDIA H100', index: 1, node: 'gpu-a' })).toBe('GPU 1 on gpu-a · NVIDIA H100');
    expect(deviceLabel({ uuid: 'u2', name: 'NVIDIA H100' })).toBe('NVIDIA H100');
  });
});
