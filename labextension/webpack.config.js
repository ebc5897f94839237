// Merged into @jupyterlab/builder's configuration (package.json: jupyterlab.webpackConfig).
// Module ids numbered in order instead of hashed from module names: the federation container's
// name holds absolute paths, which differ between checkouts, and so would the committed build.
module.exports = {
  optimization: { moduleIds: 'natural' }
};
