import { describe, expect, it } from 'vitest';

import { ElasticKernel, hibernateText, sizeChoices, statusText } from '../src/model';

function kernel(over: Partial<ElasticKernel> = {}): ElasticKernel {
  return {
    id: 'k1',
    name: 'python3-gpu-small',
    profile: 'small',
    state: 'running',
    execution_state: 'idle',
    owner: 'me',
    slice: { devices: ['GPU-0'] },
    activity: { gpu_utilization: 37.4, gpu_memory_mib: 2048, idle_seconds: 185, warning: null },
    resume: null,
    ...over
  };
}

describe('statusText with the settings', () => {
  it('leaves out what the user switched off, never the state', () => {
    const none = { size: false, gpuUse: false, idleTime: false };
    expect(statusText(kernel(), undefined, undefined, none)).toBe('idle');
    expect(statusText(kernel(), undefined, undefined, { ...none, size: true })).toBe('GPU small · idle');
    expect(statusText(kernel(), undefined, undefined, { ...none, gpuUse: true })).toBe('37% · 2.0 GiB · idle');
    expect(statusText(kernel(), undefined, undefined, { ...none, idleTime: true })).toBe('idle for 3 min');
    expect(statusText(kernel({ state: 'hibernated' }), undefined, undefined, none)).toBe('hibernated');
  });
});

describe('sizeChoices', () => {
  const profiles = [
    { name: 'whole', display_name: 'Python 3 · GPU whole', gpu_fraction: 1, memory_mib: null, fits_now: false },
    { name: 'small', display_name: 'Python 3 · GPU small', gpu_fraction: 0.25, memory_mib: 10240, fits_now: true },
    { name: 'medium', display_name: 'Python 3 · GPU medium', gpu_fraction: 0.5, memory_mib: 20480, fits_now: true },
    { name: 'huge', display_name: 'Python 3 · GPU huge', gpu_fraction: 0.5, memory_mib: 100000, fits_ever: false }
  ];
  it('lists the other sizes that ever fit, smallest first, saying which must wait', () => {
    expect(sizeChoices(profiles, 'small')).toEqual([
      { name: 'medium', label: 'medium (50% of a GPU, 20.0 GiB)' },
      { name: 'whole', label: 'whole (1 GPU) · waits for a free slice' }
    ]);
  });
});

describe('hibernateText', () => {
  it('says how much of the checkpoint is written', () => {
    expect(hibernateText({ written_mib: 120, expected_mib: 400 })).toBe('hibernating: 120 MiB of about 400 MiB written');
    expect(hibernateText({})).toBe('hibernating');
    expect(hibernateText(null)).toBe('hibernating');
    expect(statusText(kernel({ state: 'hibernating', hibernate: { written_mib: 2048, expected_mib: 0 } }))).toBe(
      'GPU small · hibernating: 2.0 GiB written'
    );
  });
});
